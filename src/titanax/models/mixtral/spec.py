"""The mixtral ModelSpec: what the rest of titanax asks of this architecture (models/spec.py),
registered under model.arch='mixtral' in titanax/archs.py."""

from titanax.models.common.decoder import init_cache
from titanax.models.common.moe_bias import moe_self_updated
from titanax.models.common.moe_hooks import moe_aux_losses, moe_aux_metrics, moe_flops_per_token
from titanax.models.common.moe_plan import MOE_PLANNER
from titanax.models.mixtral.config import MixtralConfig
from titanax.models.mixtral.hf import HF
from titanax.models.mixtral.model import Mixtral
from titanax.models.mixtral.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="mixtral", config=MixtralConfig, build=Mixtral, init_cache=init_cache,
                 presets=PRESETS, flops=moe_flops_per_token, aux_losses=moe_aux_losses,
                 aux_metrics=moe_aux_metrics, self_updated=moe_self_updated, hf=HF,
                 planner=MOE_PLANNER)
