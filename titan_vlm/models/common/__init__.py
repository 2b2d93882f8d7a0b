"""What every family shares: the Llama-shaped decoder (decoder.py, text_args.py: RMSNorm, RoPE,
grouped-query attention, SwiGLU), activations by their Hugging Face names, reading a folder's
config.json (hf_config.py: `Section` and the text model's keys) and its safetensors files
(hf_folder.py). A family's folder (models/<model_type>/) imports from here; nothing here names a
family."""
