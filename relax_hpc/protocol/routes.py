"""The engine protocol's routes, in one table: every sender (the driver, the weight channels, the
elastic scaler) names a route from here, and the built-in engine dispatches from the same table,
so a route's path and its request class are written once. tests/unit/test_sglang_contract.py
checks every path against SGLang's HTTP server and every request class against SGLang's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relax_hpc.protocol import requests as P


@dataclass(frozen=True, slots=True)
class Route:
    method: Literal["GET", "POST"]
    path: str
    request: type | None = None  # the class of a POST's body (None: the body is not read)


GENERATE = Route("POST", "/generate", P.GenerateReqInput)
HEALTH = Route("GET", "/health")
HEALTH_GENERATE = Route("GET", "/health_generate")
MODEL_INFO = Route("GET", "/model_info")
GET_MODEL_INFO = Route("GET", "/get_model_info")
FLUSH_CACHE = Route("POST", "/flush_cache")
ABORT_REQUEST = Route("POST", "/abort_request", P.AbortReq)
PAUSE_GENERATION = Route("POST", "/pause_generation", P.PauseGenerationReqInput)
CONTINUE_GENERATION = Route("POST", "/continue_generation", P.ContinueGenerationReqInput)
INIT_WEIGHTS_UPDATE_GROUP = Route("POST", "/init_weights_update_group", P.InitWeightsUpdateGroupReqInput)
DESTROY_WEIGHTS_UPDATE_GROUP = Route("POST", "/destroy_weights_update_group", P.DestroyWeightsUpdateGroupReqInput)
BEGIN_WEIGHT_UPDATE = Route("POST", "/begin_weight_update", P.BeginWeightUpdateReqInput)
END_WEIGHT_UPDATE = Route("POST", "/end_weight_update", P.EndWeightUpdateReqInput)
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Route(
    "POST", "/update_weights_from_distributed", P.UpdateWeightsFromDistributedReqInput
)
UPDATE_WEIGHTS_FROM_DISK = Route("POST", "/update_weights_from_disk", P.UpdateWeightFromDiskReqInput)
UPDATE_WEIGHTS_FROM_TENSOR = Route("POST", "/update_weights_from_tensor", P.UpdateWeightsFromTensorReqInput)
GET_WEIGHTS_BY_NAME = Route("POST", "/get_weights_by_name", P.GetWeightsByNameReqInput)
RELEASE_MEMORY_OCCUPATION = Route("POST", "/release_memory_occupation", P.ReleaseMemoryOccupationReqInput)
RESUME_MEMORY_OCCUPATION = Route("POST", "/resume_memory_occupation", P.ResumeMemoryOccupationReqInput)
LOAD_LORA_ADAPTER = Route("POST", "/load_lora_adapter", P.LoadLoRAAdapterReqInput)
UNLOAD_LORA_ADAPTER = Route("POST", "/unload_lora_adapter", P.UnloadLoRAAdapterReqInput)
UPDATE_WEIGHT_VERSION = Route("POST", "/update_weight_version", P.UpdateWeightVersionReqInput)
WEIGHTS_CHECKER = Route("POST", "/weights_checker", P.CheckWeightsReqInput)  # relax_hpc.weights.verify

# Every route of the protocol (each constant above), by (method, path): what the built-in engine serves.
ROUTES: dict[tuple[str, str], Route] = {(r.method, r.path): r for r in list(globals().values()) if isinstance(r, Route)}
