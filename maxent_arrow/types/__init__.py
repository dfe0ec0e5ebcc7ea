"""The seed's per-batch dataclasses (``rewards``) and the settings types they name."""
