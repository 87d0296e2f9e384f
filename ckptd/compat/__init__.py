"""Drop-in names for users of the libraries ckptd replaces.

- :mod:`ckptd.compat.forgather`: Forgather's ``forgather.ml.sharded_checkpoint``.
- :mod:`ckptd.compat.modelopt`: ModelOpt's ``sharded_checkpoint_utils`` (an owned-keys function
  where it takes a block descriptor).
- :mod:`ckptd.compat.megatron`: Megatron-Core ``dist_checkpointing`` names ckptd shares.

Each module sits on top of ckptd's core; nothing in the core imports them.
"""
