"""A variant's name is a pure function of its fields and parses back."""
import pytest

from codegen.config import load_config
from codegen.paths import CHECKOUT as ROOT
from codegen.variant import Variant


def test_name_round_trip_for_every_default_variant():
    variants = load_config(ROOT / "variants.yaml").variants()
    names = [v.name for v in variants]
    assert len(set(names)) == len(names)
    for v in variants:
        assert Variant.from_name(v.name) == v
        assert v.name.isidentifier()  # usable as a C symbol and a file stem


def test_name_spelling():
    assert Variant(16, 64, "bf16", True).name == "mla_decode_h16_p64_bf16_split"
    assert Variant(128, 1, "fp16", False).name == "mla_decode_h128_p1_fp16_nosplit"
    assert Variant(16, 64, "fp8_e4m3", True).name == "mla_decode_h16_p64_fp8_e4m3_split"
    assert Variant.from_name("mla_decode_h16_p64_fp8_e4m3_split") == Variant(16, 64, "fp8_e4m3", True)
    assert Variant(16, 64, "fp8_e4m3", True).cpp_type == "cutlass::float_e4m3_t"


@pytest.mark.parametrize("bad", ["mla_decode_h16_p64_bf16", "mla_decode_h0_p64_bf16_split", "mla_decode_h16_p64_fp8_split",
                                 "decode_h16_p64_bf16_split", "mla_decode_h16_p64_bf16_split_x",
                                 "mla_decode_h16_p64_fp8_e5m2_split", "mla_decode_h16_p64__split",
                                 "mla_decode_h16_p64_bf16_split\n", " mla_decode_h16_p64_bf16_split"])
def test_bad_names_are_rejected(bad):
    with pytest.raises(ValueError, match="variant name"):
        Variant.from_name(bad)


@pytest.mark.parametrize("fields,arg", [((0, 64, "bf16", True), "num_heads"), ((16, 0, "bf16", True), "page_size"),
                                        ((16, 64, "int8", True), "dtype"), ((16, 64, "bf16", 1), "split")])
def test_bad_fields_are_rejected(fields, arg):
    with pytest.raises(ValueError, match=f"Variant.{arg}"):
        Variant(*fields)
