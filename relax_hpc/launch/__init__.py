"""Inside the allocation: recover RUN_DIR, start the roles as processes, supervise, stop cleanly."""
