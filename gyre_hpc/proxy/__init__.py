"""The proxy between agent harnesses and engines: OpenAI API in, SGLang-native API out, TITO log."""
