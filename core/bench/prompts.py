"""The bench's three prompts (echo-heavy, partial echo, nothing to copy) and the token ids every engine is fed."""

from __future__ import annotations

import os

CODE_FUNCTION = '''def summarize_orders(orders, tax_rate):
    total = 0.0
    count = 0
    largest = None
    by_customer = {}
    for order in orders:
        if order.get("cancelled"):
            continue
        amount = order["quantity"] * order["unit_price"]
        amount = amount * (1 + tax_rate)
        total += amount
        count += 1
        if largest is None or amount > largest:
            largest = amount
        customer = order["customer"]
        if customer not in by_customer:
            by_customer[customer] = 0.0
        by_customer[customer] += amount
    if count == 0:
        return {"total": 0.0, "count": 0, "average": 0.0, "largest": 0.0, "by_customer": {}}
    average = total / count
    top_customer = max(by_customer, key=by_customer.get)
    return {
        "total": round(total, 2),
        "count": count,
        "average": round(average, 2),
        "largest": round(largest, 2),
        "by_customer": by_customer,
        "top_customer": top_customer,
    }'''

SOURCE_PASSAGE = (
    "The city council voted on Tuesday to convert the old railway depot on Harbor Street into a public "
    "library and community workshop. The building, which has stood empty since the freight line closed in "
    "1998, will keep its brick facade and iron roof trusses. \"We want people to see the history of this "
    "place every time they walk in,\" said council member Ana Ruiz, who proposed the plan. The renovation "
    "is expected to cost 14 million dollars, of which 9 million will come from a state grant for historic "
    "buildings and the rest from the city's capital budget. Construction will begin next spring and should "
    "take about two years. The workshop will offer tools for woodworking, electronics and bicycle repair, "
    "and volunteers from the local makers' association have offered to run evening classes. Some residents "
    "worried about parking, but the council noted that the site is two blocks from the central bus station "
    "and will include covered racks for two hundred bicycles.")

PROMPTS: dict[str, str] = {
    # echo-heavy: the answer is mostly a copy of the prompt, where n-gram lookup shines
    "code": "Rename the variable `amount` to `line_total` in this Python function and print the whole "
            "function, unchanged otherwise:\n\n```python\n" + CODE_FUNCTION + "\n```",
    # partial echo: quoted sentences come from the source, the rest is new text
    "summary": "Summarize the following news article in one paragraph, quoting its two or three key sentences "
               "word for word:\n\n" + SOURCE_PASSAGE,
    # nothing to copy: speculation has to pay for itself on fresh text
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def prompt_ids(model_path: str | os.PathLike, text: str, chat: bool = True) -> tuple[list[int], bool]:
    """Token ids for `text` (chat template applied when the model has one and `chat`), and whether the
    template was applied. The same ids are fed to every engine, so tokenizers cannot differ."""
    from outrider.io.chat import prompt_ids as chat_prompt_ids
    from outrider.io.chat import template_or_raw_ids
    from outrider.io.gguf import GGUFFile
    from outrider.io.tokenizer import Tokenizer

    gguf = GGUFFile(model_path)
    tokenizer = Tokenizer.from_gguf(gguf)
    if chat:
        return template_or_raw_ids(gguf, tokenizer, text)
    return chat_prompt_ids(gguf, tokenizer, text, chat=False), False
