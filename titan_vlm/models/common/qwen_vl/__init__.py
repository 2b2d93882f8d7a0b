"""What the Qwen-VL families (models/qwen2_5_vl, models/qwen3_vl) share: their args (Qwen2.5-VL's
shapes, which Qwen3-VL's extend), images at native resolution in a batch and their M-RoPE
positions, the processor and tokenizer of a folder, the tower's packed attention blocks, the
model's verbs (QwenVLModel) and decoder with per-slot M-RoPE, the FLOPs and CP cost model, and
the checks of a job. A family folder holds what is its own (its tower, its config.json reading,
its tensor names, its parallel plan)."""
