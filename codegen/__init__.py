"""mla-variants code generator: variants.yaml -> rendered CUDA sources -> CMake build -> manifest.json.

Follow one call through these modules:
  config.py   reads and validates variants.yaml (errors name the line);
  variant.py  the Variant record, whose ``name`` is the file, symbol, manifest and dispatch key, and its
              PathFacts (which kernels it runs), computed once here;
  render.py   renders templates/ into generated/ (deterministic, write-if-changed, hashed headers) and
              the manifest the runtime loads;
  manifest.py reads and checks a build's manifest (the runtime and `list` share it);
  build.py    configures and runs CMake + ninja, records nvcc resource usage, rejects spills;
  cli.py      the ``mla-variants`` / ``python -m codegen`` command line.
"""
