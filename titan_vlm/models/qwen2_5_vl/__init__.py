"""The "qwen2_5_vl" family (transformers' Qwen2_5_VLForConditionalGeneration): a ViT over native
resolution images and videos (3-D patches, 2-D rotary positions, window attention with a few
full-attention layers, a 2x2 patch merger) feeding a Qwen2 decoder with multimodal RoPE.

    args.py        VisionArgs and Qwen25VLArgs
    hf_config.py   a Qwen2.5-VL config.json (transformers 4.x or 5.x) -> the args
    hf_adapter.py  Hugging Face tensor names <-> parameter names, both ways
    vision.py      the vision tower and its patch merger
    mrope.py       the rows' 3-D positions (get_rope_index) and M-RoPE's cos / sin
    model.py       Qwen25VL: vision tower -> decoder, single process; loading a folder
    processor.py   the data side: pixel_values and grid_thw of images and videos

Each part computes what transformers computes (tests/unit/test_qwen2_5_vl_model.py and
test_qwen2_5_vl_processor.py). Not yet in the registry (models/registry.py): the trainer refuses
a qwen2_5_vl folder in one line until the family's ModelSpec (its data path, CP forward and
parallelize) lands.
"""
