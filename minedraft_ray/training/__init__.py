"""Training of the embedded default draft/target pair (corpus from site-packages, tokenizer, target, distilled draft).

`python -m minedraft_ray.training.train_pair --out OUT --time-budget-s 500`; docs/default-models.md says more.
"""
