"""Specs: the model, the cluster and the plan, validated; presets and Hugging Face import."""
