"""Pydantic models shared by every component. Imports no other lorafn package."""

from lorafn.api.specs import (
    API_VERSION,
    GROUP,
    SLO,
    VERSION,
    AdapterRef,
    Auth,
    BackboneSpec,
    FunctionRef,
    GenerationDefaults,
    GPUDevice,
    LoRAFunctionSpec,
    ModelRef,
    Placement,
    Resources,
    Scaling,
    SecretKeyRef,
    WarmPool,
)
from lorafn.api.uris import ArtifactURI, parse_uri

__all__ = [
    "API_VERSION",
    "GROUP",
    "SLO",
    "VERSION",
    "AdapterRef",
    "ArtifactURI",
    "Auth",
    "BackboneSpec",
    "FunctionRef",
    "GPUDevice",
    "GenerationDefaults",
    "LoRAFunctionSpec",
    "ModelRef",
    "Placement",
    "Resources",
    "Scaling",
    "SecretKeyRef",
    "WarmPool",
    "parse_uri",
]
