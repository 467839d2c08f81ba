"""Fragments of the completion schema and of the garbage models emit, for generated inputs.

Shared by the core's property tests and the server's hostile-input tests.
"""

PIECES = [
    "<strategy>",
    '<strategy id="1">',
    "<Strategy id=x>",
    "</strategy>",
    "</ strategy>",
    "</strategy >",
    "<reasoning>",
    "</reasoning>",
    "<strategy_outcome>",
    "</strategy_outcome>",
    "<final_answer>",
    "</final_answer>",
    "<answer>",
    "</answer>",
    "<ｓtrategy>",
    "<",
    ">",
    "</",
    "```python",
    "~~~",
    "**",
    "__",
    "####",
    "\\boxed{",
    "\\frac{1}{0}",
    "}",
    "{",
    "18",
    "-0.000",
    "9" * 1200,
    "1/0",
    "(B)",
    "answer is c",
    "\x00",
    "\x1b[31m",
    "\u200b",
    "\ufeff",
    "\u2028",
    "ǅ",
    "ﬁ",
    "𝟙𝟠",
    "\U0001f600",
    " ",
    "\n",
    "\t",
]

#: Answers that send math-verify (sympy) into integer arithmetic lasting hours while holding the
#: GIL; each was measured to outlive a 3 s limit.
PATHOLOGICAL_MATH = [
    "$9^{9^{9^{9}}}$",
    "\\boxed{10^{10^{10^{10}}}}",
    "$(10^{10})!$",
]
