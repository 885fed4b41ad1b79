"""The weight channel: parameters from the trainer to the engines in flat buckets over a
torch.distributed side group formed the way SGLang's /init_weights_update_group defines it.
`sender` is the trainer's half, `receiver` the built-in engine's; both import only the protocol.
For vLLM engines, `vllm_channel` is the trainer's half (vLLM's weight-transfer routes) and
`vllm_gloo` the engine's (a vLLM WeightTransferEngine, loaded by vLLM's plugin entry point)."""
