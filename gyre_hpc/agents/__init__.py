"""The built-in agent harness: a tool-calling loop that talks to the model only through the proxy."""
