"""Reasoning output: a parser per output format splits what a reasoning model writes into its
reasoning (`reasoning_content`) and its answer (`content`, and tool calls where the format
carries them), and tells the grammar of a structured output where the answer starts.

    harmony (gpt-oss, `openai_gptoss`):   <|channel|>analysis<|message|>...<|end|>
                                          <|start|>assistant<|channel|>final<|message|>...<|return|>
    think (`qwen3`, `deepseek_r1`):       <think>...</think>answer

The parser is chosen from the model (registry.py), or named (`reasoning_parser`, vLLM's
`--reasoning-parser`).
"""
