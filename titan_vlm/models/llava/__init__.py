"""The "llava" family (transformers' LlavaForConditionalGeneration): a CLIP- or SigLIP-shaped ViT
and an MLP projector feeding a Llama / Mistral / Qwen2 / Qwen3 decoder.

    args.py        ViTArgs, VLMArgs and the built-in flavors (debug, small, llava7b)
    hf_config.py   a LLaVA / CLIP / SigLIP config.json -> the args
    hf_adapter.py  Hugging Face tensor names <-> parameter names, both ways
    vit.py         the vision tower
    model.py       VLM: ViT -> projector -> decoder (models/spec.py VisionLanguageModel)
    flops.py       model FLOPs and the CP cost model's weights
    spec.py        LLAVA: the family's ModelSpec (the registry's entry)
"""
