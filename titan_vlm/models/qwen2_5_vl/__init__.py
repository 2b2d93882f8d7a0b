"""The "qwen2_5_vl" family (transformers' Qwen2_5_VLForConditionalGeneration): a ViT over native
resolution images and videos (3-D patches, 2-D rotary positions, window attention with a few
full-attention layers, a 2x2 patch merger) feeding a Qwen2 decoder with multimodal RoPE.

    args.py          VisionArgs and Qwen25VLArgs
    hf_config.py     a Qwen2.5-VL config.json (transformers 4.x or 5.x) -> the args
    hf_adapter.py    Hugging Face tensor names <-> parameter names, both ways
    vision.py        the vision tower and its patch merger
    vision_cost.py   the tower's FLOPs per image (window and full attention as they are)
    mrope.py         the rows' 3-D positions (get_rope_index) and M-RoPE's cos / sin
    model.py         Qwen25VL: vision tower -> decoder, its forward over a rank's batch
    images.py        QwenRule and QwenVisuals: how its images and videos take slots and travel
    processor.py     the data side: pixels and grids of images and videos (and which frames of
                     a video file), the prompt's placeholders, the folder's chat processor
    flops.py         model FLOPs and the CP cost model's weights
    parallelize.py   compile, activation checkpointing and FSDP from outside
    validate.py      what it needs of the job's shapes and mesh
    spec.py          QWEN2_5_VL, its ModelSpec (models/registry.py)

Each part computes what transformers computes (tests/unit/test_qwen2_5_vl_*.py,
tests/test_qwen2_5_vl_*.py).
"""
