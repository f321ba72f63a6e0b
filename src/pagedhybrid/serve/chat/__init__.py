"""OpenAI chat in the Qwen3.5 format: ``format.py`` (templates' messages, tools, tool_choice
as a grammar, thinking) and ``parser.py`` (an answer split into reasoning, content and tool
calls, as it streams); ``LLM.chat`` and the server's chat completions share both.
"""
