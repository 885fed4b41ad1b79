"""Sample exchange between the rollout driver and the trainer: HDF5 batch files in RUN_DIR/spool."""
