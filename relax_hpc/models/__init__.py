"""Model and tokenizer construction (HF transformers classes, built offline)."""
