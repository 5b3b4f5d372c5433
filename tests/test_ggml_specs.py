"""quant.ggml_quants' one spec per GGML type against gguf's own sizes: the bits a spec names (codes, sub-block
scale codes, its FP16 or E8M0 super-block scales) add up to gguf's bytes per block, for every type, so a number
of a spec that is wrong shows in a size llama.cpp's Python package knows independently; and grep finds each
type in its spec, not in the functions that read it."""
import os
import re

import pytest
from gguf.constants import GGML_QUANT_SIZES

from conftest import ROOT
from quant import formats
from quant import ggml_quants as G


@pytest.mark.parametrize("t", G.TYPES, ids=lambda t: t.name)
def test_a_specs_bits_make_ggufs_bytes_per_block(t):
    spec = G.SPECS[t]
    weights, size = GGML_QUANT_SIZES[t]
    assert spec.block == weights and weights % spec.sub == 0
    mins = "dmin" in spec.fields  # an affine type stores a min code beside each scale code, and dmin beside d
    scale_codes = weights // spec.sub * (2 if mins else 1) * spec.scale_bits if spec.scale_bits else 0
    block_scales = 8 if spec.fields.startswith("e ") else 16 * (2 if mins else 1)  # E8M0, or FP16 d (and dmin)
    assert weights * spec.code_bits + scale_codes + block_scales == 8 * size


def test_the_specs_are_the_export_formats_in_their_order():
    """formats.GGML_FORMATS (a file stores a format's position there) names the specs' types, in their order."""
    assert list(formats.GGML_FORMATS.values()) == [t.name for t in G.SPECS]


def test_each_type_is_named_in_its_spec_and_read_from_it_by_the_functions():
    """No function of ggml_quants.py tests for a type: `T.<TYPE>` appears only in the specs' table."""
    with open(os.path.join(ROOT, "quant", "ggml_quants.py"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("SPECS = {"):text.index(")}", text.index("SPECS = {"))]
    outside = text.replace(table, "")
    assert not re.findall(r"\bT\.(?:Q\d|IQ|MXFP)", outside)
    assert len(re.findall(r"BlockType\(T\.", table)) == len(G.TYPES)
