"""mla-variants code generator: variants.yaml -> rendered CUDA sources -> CMake build -> dispatch table.

Follow one call through these modules:
  config.py   reads and validates variants.yaml (errors name the line);
  variant.py  the Variant record, whose ``name`` is the file, symbol, manifest and dispatch key;
  render.py   renders templates/ into generated/ (deterministic, write-if-changed, hashed headers);
  build.py    configures and runs CMake + ninja, records nvcc resource usage, rejects spills;
  cli.py      the ``mla-variants`` / ``python -m codegen`` command line.
"""
