"""Layouts: map every tensor name of a model to a unit (embed, layer.<i>, norm, head, other).

Model families are JSON data in ``families/``; one generic code path in ``layout.py`` reads them.
"""

from llmtailor.layouts.layout import (
    FamilySpec,
    Layout,
    build_layout,
    layout_from_names,
    list_families,
    load_family,
    name_units,
    unit_rank,
)

__all__ = ["FamilySpec", "Layout", "build_layout", "layout_from_names", "list_families", "load_family", "name_units",
           "unit_rank"]
