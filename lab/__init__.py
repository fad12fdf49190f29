"""Not an importable product package (setuptools installs codegen and mla_variants only): this file and
lab/tests/__init__.py make pytest name lab/tests modules lab.tests.*, apart from tests/ conftest."""
