"""The "qwen3_vl" family: Qwen3-VL (dense), transformers' Qwen3VLForConditionalGeneration."""
