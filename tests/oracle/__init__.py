"""Helpers around llama.cpp (through llama-cpp-python), the reference the engine is checked against."""
