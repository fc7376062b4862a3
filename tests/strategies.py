"""Hypothesis strategies for values of any postcard wire type: the codec's property tests draw
them, and so does the reliability fuzz row."""

import dataclasses

from hypothesis import strategies as st

from proto import postcard as pc

SCALARS = {
    "u8": st.integers(0, 0xFF),
    "u16": st.integers(0, 0xFFFF),
    "u32": st.integers(0, 0xFFFFFFFF),
    "u64": st.integers(0, (1 << 64) - 1),
    "bool": st.booleans(),
    "f32": st.floats(width=32, allow_nan=False),
    "String": st.text(max_size=12),
    "Vec<u8>": st.binary(max_size=24),
    "[u8; 32]": st.binary(min_size=32, max_size=32),
    "()": st.none(),
}


def values(annotation):
    """Values of any wire type, with lists kept short."""
    w = pc.wire_type(annotation)
    if w.name in SCALARS:
        return SCALARS[w.name]
    if isinstance(w, pc._VecType):
        return st.lists(values(w.elem), max_size=3)
    if isinstance(w, pc._OptionType):
        return st.none() | values(w.inner)
    if isinstance(w, pc._TupleType):
        return st.tuples(*map(values, w.elems))
    if isinstance(w, pc._UnitEnum):
        return st.sampled_from(w.members)
    if isinstance(w, pc._DataEnum):
        return st.one_of([structs(v) for v in w.variants])
    return structs(w.cls)


def structs(cls):
    return st.builds(cls, **{f.name: values(f.type) for f in dataclasses.fields(cls)})
