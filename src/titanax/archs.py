"""model.arch -> the package of that architecture under titanax/models/: the one line a new
architecture adds. Plain data, imported by the config (which finds each architecture's config
class in PACKAGE.config, jax-free) and by models/registry.py (its ModelSpec in PACKAGE.spec)."""

ARCHS: dict[str, str] = {
    "llama3": "titanax.models.llama3",
    "qwen3": "titanax.models.qwen3",
    "mistral": "titanax.models.mistral",
    "mixtral": "titanax.models.mixtral",
    "qwen3_moe": "titanax.models.qwen3_moe",
}
