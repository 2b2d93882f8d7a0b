"""titan_vlm: a PyTorch-native trainer for long-context vision-language models."""
