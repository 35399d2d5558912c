"""Name and layout mappings, listed once in :mod:`shardkit.layouts.registry`: fp8 and fp4 scales, GGUF names,
diffusers ↔ original single file. Imports only top level and formats; torch and diffusers inside functions."""
