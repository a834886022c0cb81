#!/usr/bin/env python3
"""Writes tiny/data/tiny_corpus.txt: the training text of the make-tiny BPE tokenizer.

k3's own varied corpus (~200 KB): hand-written English prose, templated sentences, code in
several languages, numbers/dates/tables, accented European text, CJK, a little emoji. It is
deterministic (fixed seed) and kept in the repo; tiny/tiny_corpus.c embeds it in the binary
(regenerate both with: python3 tiny/data/make_corpus.py && python3 tiny/data/embed_corpus.py).
"""
import random, os

R = random.Random(20260)
out = []

PROSE = """The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps
as his father had taught him: one hundred and twelve, no more and no less. From the lantern room he
could see the whole bay, the fishing boats returning with their nets folded, and the gulls wheeling
over the harbour wall. Nobody had asked him to keep a journal, but he wrote in it anyway, noting the
wind, the colour of the sea and the names of the ships that passed.

In the spring the river rose and flooded the low fields. Farmers moved their sheep to the hills and
waited. When the water finally went down it left a layer of dark silt that made the next harvest
the best anyone could remember. "It's always like that," said the old miller. "The river takes, and
then it gives back twice as much."

A good engineer reads the error message before changing the code. She writes down what she
expected, what happened instead, and the smallest input that shows the difference. Only then does
she open the debugger. Most bugs, she says, are not clever; they are simply unexamined assumptions.

The library closed at eight, but the reading room stayed lit until the last student left. Rows of
green lamps glowed over oak tables, and the only sound was the turning of pages and the occasional
cough. On the top shelf, behind a glass door, stood the atlases: heavy, leather-bound volumes that
showed the world as people imagined it three centuries ago.

We measured the throughput three times and took the median. The first run was slower because the
cache was cold; the second and third agreed to within two percent. When we doubled the batch size
the latency rose by only eleven percent, which suggests the kernel was limited by memory bandwidth
rather than by arithmetic.

Weather report: a band of rain will move east overnight, clearing by mid-morning. Expect highs of
14 degrees, light winds from the south-west, and a chance of fog along the coast. The weekend looks
dry and mild, with sunshine on Saturday and scattered clouds on Sunday afternoon.

She didn't want to leave, but the train wouldn't wait. They'd said goodbye twice already; the third
time felt like a promise rather than a farewell. I'll write, she said. You always say that, he
answered, and they both laughed, because it was true and because she always did.
"""

NOUNS = "system model token layer expert router kernel buffer packet cluster node rank stage lane " \
        "river mountain city garden window bridge teacher student doctor artist farmer sailor " \
        "engine matrix vector tensor shard header index config parser server client request " \
        "answer question problem result theory experiment sample signal pattern memory".split()
VERBS = "reads writes builds checks splits merges sends receives measures compares loads stores " \
        "opens closes follows explains computes predicts returns ignores repeats describes " \
        "carries moves finds keeps shows needs holds turns starts stops".split()
ADJS = "small large quiet bright careful fast slow simple complex hidden open narrow wide ancient " \
       "modern early late strange familiar distant local global random stable fragile robust " \
       "empty full warm cold sharp gentle".split()
ADVS = "quickly slowly carefully rarely often always never quietly suddenly eventually".split()
NAMES = "Alice Bob Carol Dmitri Elena Farah Gustavo Hana Ivan Julia Kenji Lena Mateo Nadia Omar " \
        "Priya Quentin Rosa Sven Tomoko Uma Viktor Wei Ximena Yusuf Zoe".split()

def sentence():
    t = R.randrange(6)
    n1, n2 = R.choice(NOUNS), R.choice(NOUNS)
    if t == 0:
        return f"The {R.choice(ADJS)} {n1} {R.choice(VERBS)} the {n2} {R.choice(ADVS)}."
    if t == 1:
        return f"{R.choice(NAMES)} {R.choice(VERBS)} a {R.choice(ADJS)} {n1} near the {n2}."
    if t == 2:
        return f"Why does the {n1} {R.choice(VERBS)[:-1]} every {n2}? Nobody knows for sure."
    if t == 3:
        return f"If the {n1} is {R.choice(ADJS)}, then the {n2} {R.choice(VERBS)} it {R.choice(ADVS)}."
    if t == 4:
        return f"{R.choice(NAMES)}'s {n1} wasn't {R.choice(ADJS)}; it was {R.choice(ADJS)} and {R.choice(ADJS)}."
    return f"In {R.randrange(1800, 2030)}, {R.randrange(2, 999)} {n1}s {R.choice(VERBS)[:-1]} {R.randrange(3, 50)} {n2}s."

def paragraph():
    return " ".join(sentence() for _ in range(R.randrange(3, 8)))

def ident():
    parts = [R.choice(NOUNS) for _ in range(R.randrange(1, 4))]
    style = R.randrange(3)
    if style == 0:
        return "_".join(parts)
    if style == 1:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return "".join(p.capitalize() for p in parts)

def c_func():
    f, a, b = ident(), ident(), ident()
    n = R.randrange(2, 4096)
    return f"""static int {f}(const float *{a}, int64_t {b}) {{
    float acc = 0.0f;
    for (int64_t i = 0; i < {b}; i++) {{
        if ({a}[i] > {R.random():.3f}f) acc += {a}[i] * {R.randrange(1, 9)};
    }}
    return acc > {n} ? -1 : (int)acc; /* {R.choice(ADJS)} path */
}}
"""

def py_func():
    f, a = ident().lower(), ident().lower()
    return f"""def {f}({a}, limit={R.randrange(1, 100)}):
    \"\"\"Return the {R.choice(ADJS)} {R.choice(NOUNS)}s of {a}.\"\"\"
    result = []
    for i, item in enumerate({a}):
        if i >= limit:
            break
        result.append(item * {R.randrange(2, 10)} + {R.randrange(0, 100)})
    return sorted(result, reverse={R.choice(['True', 'False'])})
"""

def json_obj():
    k = [ident() for _ in range(4)]
    return ('{"%s": %d, "%s": "%s", "%s": [%s], "%s": %s}\n' %
            (k[0], R.randrange(100000), k[1], R.choice(NOUNS), k[2],
             ", ".join(str(R.randrange(1000)) for _ in range(R.randrange(1, 6))), k[3],
             R.choice(["true", "false", "null", "3.14159", "-0.5e-3"])))

def shell():
    return (f"$ k3 {R.choice(['run', 'inspect', 'bench', 'plan'])} --model /data/{ident()} "
            f"--threads {R.randrange(1, 64)} --seed {R.randrange(1 << 20)}\n"
            f"[k3 r0{R.randrange(8)} s{R.randrange(4)} e{R.randrange(4)} I] loaded {R.randrange(1, 900)} "
            f"tensors in {R.random() * 10:.2f} s ({R.random() * 20:.1f} GB/s)\n")

def table():
    rows = ["| name | count | ratio | date |", "|---|---|---|---|"]
    for _ in range(R.randrange(3, 8)):
        rows.append(f"| {ident()} | {R.randrange(10**6):,} | {R.random():.4f} | "
                    f"{R.randrange(1990, 2030)}-{R.randrange(1, 13):02d}-{R.randrange(1, 29):02d} |")
    return "\n".join(rows) + "\n"

ACCENTS = [
    "Le café était fermé, alors nous sommes allés à la bibliothèque où il faisait déjà très chaud.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte der Pilot während des Flugs.",
    "El niño comió una manzana mientras su abuela cantaba una canción antigua en la cocina.",
    "A canção da manhã acordou todos na aldeia; até o cão levantou as orelhas.",
    "Ça ne fait rien: l'élève a déjà réparé le vélo et préparé le goûter.",
    "Die Mädchen und Jungen spielten Fußball bis die Straßenlaternen angingen.",
    "Señora Núñez explicó la lección con paciencia y una sonrisa.",
    "Zażółć gęślą jaźń — a Polish pangram with every diacritic.",
    "Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Árvíztűrő tükörfúrógép, says the Hungarian test sentence.",
]
CJK = [
    "今天天气很好，我们去公园散步吧。", "机器学习模型需要大量的数据和计算资源。",
    "这个系统把每一层的专家分配到不同的节点上。", "请在下午三点之前提交你的报告。",
    "東京の夜景はとても美しいです。", "私は毎朝コーヒーを飲みながら新聞を読みます。",
    "このプログラムは大きな行列を小さなブロックに分けて計算します。",
    "한국어 문장도 조금 포함되어 있습니다.", "中文English混合的句子也很常见。",
    "北京、上海和深圳都是重要的城市。",
]
EMOJI = ["🙂", "🚀", "✅", "🔥", "🌍", "📦", "⚙️", "👍🏽"]

out.append(PROSE)
while sum(len(x.encode()) for x in out) < 200_000:
    k = R.randrange(20)
    if k < 7:
        out.append(paragraph() + "\n\n")
    elif k < 9:
        out.append(c_func() + "\n")
    elif k < 11:
        out.append(py_func() + "\n")
    elif k < 12:
        out.append(json_obj())
    elif k < 13:
        out.append(shell())
    elif k < 14:
        out.append(table() + "\n")
    elif k < 16:
        out.append(" ".join(R.sample(ACCENTS, 3)) + "\n\n")
    elif k < 18:
        out.append("".join(R.sample(CJK, 3)) + "\n\n")
    elif k < 19:
        out.append(f"Total: {R.randrange(10**9)} bytes, {R.random() * 1e4:.3f} ms, "
                   f"{R.randrange(-500, 500)}°C, ID #{R.randrange(10**6):06d} {R.choice(EMOJI)}\n")
    else:
        out.append(PROSE.split("\n\n")[R.randrange(7)] + "\n\n")

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "tiny_corpus.txt"), "w", encoding="utf-8") as f:
    f.write("".join(out))
