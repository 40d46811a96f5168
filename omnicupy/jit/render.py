"""Render kernel templates to CUDA source. Knows Jinja2, not NVRTC."""
from __future__ import annotations

import functools

import jinja2

from . import env
from .spec import KernelSpec


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(env.templates_dir())),
        undefined=jinja2.StrictUndefined,  # a missing parameter is an error, never an empty string
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_source(variant: KernelSpec) -> str:
    return _environment().get_template(variant.template).render(**variant.template_params())


@functools.lru_cache(maxsize=1)
def headers_digest_material() -> str:
    """The text of every header in kernels/, so that editing a header changes every cache key."""
    parts = []
    for path in sorted(env.kernels_dir().glob("*.cuh")):
        parts.append(f"// {path.name}\n{path.read_text()}")
    return "\n".join(parts)
