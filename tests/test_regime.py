"""The low-load regime choice of psd (runtime/regime.py): measure both, run the faster, re-measure."""
from minedraft_ray.runtime.regime import RegimeChooser


def feed(chooser, step, cadences):
    """Run the chooser for steps, feeding the chosen regime's cadence; returns (next step, regimes run)."""
    regimes = []
    for _ in range(cadences["n"]):
        regime = chooser.choose(step)
        regimes.append(regime)
        chooser.observe(regime, cadences[regime], step)
        step += 1
    return step, regimes


def test_measures_psd_then_seq_then_runs_the_faster():
    chooser = RegimeChooser(explore_every=100, explore_steps=4)
    step, regimes = feed(chooser, 0, {"psd": 20.0, "seq": 12.0, "n": 30})
    assert regimes[:4] == ["psd"] * 4 and regimes[4:8] == ["seq"] * 4
    assert set(regimes[8:]) == {"seq"}
    assert abs(chooser.cost["psd"] - 20.0) < 1e-9 and abs(chooser.cost["seq"] - 12.0) < 1e-9


def test_switches_back_when_a_re_measurement_says_so():
    chooser = RegimeChooser(explore_every=50, explore_steps=4)
    step, _ = feed(chooser, 0, {"psd": 20.0, "seq": 12.0, "n": 20})
    assert chooser.current == "seq"
    # the pair got slower to draft: sequential steps now take longer than two psd verifies
    step, regimes = feed(chooser, step, {"psd": 20.0, "seq": 30.0, "n": 120})
    assert "psd" in regimes[:60]             # psd re-measured within explore_every steps
    assert regimes[-1] == "psd" and chooser.current == "psd"


def test_no_flapping_within_the_margin():
    chooser = RegimeChooser(explore_every=10**6, explore_steps=3, margin=0.05)
    _, regimes = feed(chooser, 0, {"psd": 10.0, "seq": 9.8, "n": 40})   # seq 2 % faster: keep psd
    assert set(regimes[6:]) == {"psd"}


def test_an_outlier_step_does_not_decide():
    """A regime's cost is the median of its latest samples: one step that captured a CUDA graph (or waited on
    anything else once) inside a trial does not make that regime look slower."""
    chooser = RegimeChooser(explore_every=10**6, explore_steps=5)
    for step, value in enumerate([9.0, 250.0, 9.5, 8.5, 9.0]):   # psd's trial, one capture among its steps
        assert chooser.choose(step) == "psd"
        chooser.observe("psd", value, step)
    step, regimes = feed(chooser, 5, {"psd": 9.0, "seq": 16.0, "n": 20})
    assert regimes[:5] == ["seq"] * 5 and set(regimes[5:]) == {"psd"}
    assert chooser.cost["psd"] == 9.0


def test_high_load_order_measures_the_sequential_batch_first():
    """The high-load chooser measures seq first (demand rises from one batch: no drain), then the split."""
    chooser = RegimeChooser(explore_every=2000, explore_steps=3, current="seq", order=("seq", "psd"))
    _, regimes = feed(chooser, 0, {"psd": 0.14, "seq": 0.26, "n": 10})
    assert regimes[:3] == ["seq"] * 3 and regimes[3:6] == ["psd"] * 3 and set(regimes[6:]) == {"psd"}


def test_time_per_row_leaves_prefills_out():
    """The high-load sample (and the bench's ms_per_row columns): verifier wall time minus prefill device time,
    per row. Counting prefills charged the split for the burst of admissions it starts with."""
    from minedraft_ray.runtime.manager import StepRecord

    record = StepRecord("psd", (2, 2), verified=2, drafted=2, step_ms=10.0, t_prefill_ms=4.0)
    assert record.ms_per_row == 3.0
