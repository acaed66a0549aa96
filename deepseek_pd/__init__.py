"""deepseek-pd: DeepSeek-V2/V3 serving with prefill/decode disaggregation.

The top-level folders model/, workers/, proto/ and operator/ are installed as
subpackages of this one (see setup.py).
"""

__version__ = "0.1.0"
