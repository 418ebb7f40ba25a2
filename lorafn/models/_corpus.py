"""A small fixed text the random models' byte-level BPE tokenizer is trained on.

Fixed (not read from the installed Python or the network) so that the same lorafn version writes the
same tokenizer bytes on every machine. `corpus_lines()` adds template sentences with numbers, code
and chat turns so that the merges cover what tests and benchmarks send.
"""

from __future__ import annotations

_PROSE = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid. The capital of Japan is Tokyo. The capital of Canada is Ottawa.
A serverless function scales to zero when nobody calls it, and comes back when a request arrives.
Each GPU holds one read-only copy of the base model; every function keeps its own small adapter.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Once upon a time there was a little robot who wanted to learn how to paint the sea.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
The train leaves the station at seven in the morning and arrives in the city at noon.
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? She sold 48 + 24 = 72 clips.
Weng earns 12 dollars an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.
Please write a short poem about autumn leaves falling slowly on a quiet street.
Summarize the following paragraph in one sentence, and keep the most important facts.
Translate into French: the cat sleeps on the warm windowsill while the rain falls outside.
Le chat dort sur le rebord de la fenêtre pendant que la pluie tombe dehors.
Bonjour, comment allez-vous ? Je vais bien, merci. La capitale de la France est Paris.
Attention is all you need: queries, keys and values, rotary position embeddings, grouped heads.
The key-value cache grows with every generated token and is freed when the request finishes.
Low-rank adaptation adds two small matrices A and B to a frozen weight W: y = xW + s(xA)B.
"""

_CODE = """\
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for i in range(10):
    print(f"{i}: {fibonacci(i)}")

class Request:
    def __init__(self, prompt, max_tokens=16, temperature=0.0):
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.temperature = temperature

{"model": "default/hello", "messages": [{"role": "user", "content": "Hi"}], "stream": true}
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name ORDER BY 2 DESC;
"""

_NAMES = ["Alice", "Bob", "Carla", "Deepak", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
_ITEMS = ["apples", "books", "pencils", "cookies", "marbles", "stickers", "tickets", "shells"]


def corpus_lines() -> list[str]:
    """The training text, one line per entry; deterministic."""
    lines = _PROSE.splitlines() + _CODE.splitlines()
    for i, name in enumerate(_NAMES):
        for j, item in enumerate(_ITEMS):
            a, b = 3 + 7 * i + j, 2 + 5 * j + i
            lines.append(
                f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? "
                f"{a} + {b} = {a + b}. #### {a + b}"
            )
    for n in range(0, 1000, 7):
        lines.append(f"{n} {n * 3} {n + 11} {n / 4:.2f} {n}%")
    for role, text in [
        ("system", "You are a helpful assistant."),
        ("user", "What is the capital of France?"),
        ("assistant", "The capital of France is Paris."),
    ]:
        lines.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")
    return lines
