"""openrlhf_mappa: train teams of LLM agents, each with its own weights, from per-action coach rewards
(MAPPA) on OpenRLHF's Ray + vLLM + DeepSpeed stack."""

__version__ = "0.1.0"
