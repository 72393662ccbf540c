"""The pieces every architecture under models/ is built from, none of them any one model's:
layers.py (parameters, RMSNorm, RoPE), attention.py (RoPE + causal attention, KV cache),
block.py (the decoder layer, configured per architecture by BlockOptions), decoder.py (the
stack: embedding, scan or pipeline, remat, loss head), sharding.py (the logical-axis table),
hf_interop.py / hf_table.py / hf_config.py (HF tensor tables and config.json)."""
