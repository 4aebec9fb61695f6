"""Bytes in and out of the process in other people's formats.

``checkpoint`` saves and loads per-rank safetensors shards with a manifest; ``full_weights``
consolidates them into one file of full weights; ``safetensors_stream`` writes safetensors one
tensor at a time and reads byte ranges; ``pretrained`` loads Hugging Face weights straight into
the shards; ``deepspeed_config`` reads a DeepSpeed ZeRO-3 config.
"""
