"""Tests inside real vLLM engines with the default model."""

# The dtype of every test engine; see the `engine` fixture in conftest.py for why not bfloat16.
TEST_DTYPE = "float32"
