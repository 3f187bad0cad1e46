"""Test helpers: tiny random checkpoints in Hugging Face format (see tiny.py)."""
