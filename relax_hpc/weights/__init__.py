"""Weight sync from the trainer to the rollout engines over a torch.distributed side group formed
the way SGLang's /init_weights_update_group defines it, in flat buckets."""
