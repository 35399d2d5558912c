"""Name and layout mappings: quantized layouts (fp8/fp4 scales), GGUF names; imports only top level and formats."""
