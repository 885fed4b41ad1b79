"""The helpers that turn a name in the config into an object: `module:attribute` references
(rollout.env.name, reward.name) and dtype names (model.dtype, an engine's --dtype)."""

import json

import pytest
import torch

from relax_hpc.config.references import BadReference, resolve_reference
from relax_hpc.models.hf import torch_dtype


def test_a_reference_is_a_builtin_or_an_imported_attribute():
    assert resolve_reference("mine", {"mine": 3}) == 3
    assert resolve_reference("json:dumps", {}) is json.dumps
    assert resolve_reference("json:decoder", {}) is json.decoder  # any attribute, a module included


@pytest.mark.parametrize(
    "name, what, message",
    [
        ("json", "attribute", r"a built-in \(mine\) or module:attribute"),
        (":dumps", "attribute", r"a built-in \(mine\) or module:attribute"),
        ("no_such_module_xyz:f", "function", r"cannot import no_such_module_xyz"),
        ("json:nope", "attribute", r"json has no attribute 'nope'"),
        ("json:decoder", "function", r"json has no function 'decoder'"),  # a module is not callable
    ],
)
def test_a_bad_reference_says_why(name, what, message):
    with pytest.raises(BadReference, match=message):
        resolve_reference(name, {"mine": 3}, what)


def test_dtype_names():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("float32") is torch.float32


@pytest.mark.parametrize("bad", ["nn", "bf16", "Tensor"])  # a module, a nickname, a class: not dtypes
def test_a_bad_dtype_name_says_so(bad):
    with pytest.raises(ValueError, match=f"'{bad}' is not a torch dtype"):
        torch_dtype(bad)
