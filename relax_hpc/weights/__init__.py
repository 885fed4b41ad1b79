"""The weight channel: parameters from the trainer to the engines in flat buckets over a
torch.distributed side group formed the way SGLang's /init_weights_update_group defines it.
`sender` is the trainer's half, `receiver` the built-in engine's; both import only the protocol."""
