//! A set of response formats with a task each: the test set of the structured-output tests
//! (unit tests on a synthetic vocabulary, the end-to-end test on the real model) and of
//! `llms bench guide`. Each schema exercises some of the keywords the compiler implements.

/// (name, task for the model, JSON Schema).
pub const SCHEMAS: &[(&str, &str, &str)] = &[
    (
        "person",
        "Give the name and age of a famous scientist as JSON.",
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":40},"age":{"type":"integer","minimum":0,"maximum":120}},"required":["name","age"],"additionalProperties":false}"#,
    ),
    (
        "yes_no",
        "Is the sky blue? Answer as JSON with a boolean field named answer.",
        r#"{"type":"object","properties":{"answer":{"type":"boolean"}},"required":["answer"]}"#,
    ),
    (
        "sentiment",
        "What is the sentiment of the sentence 'I love this phone'?",
        r#"{"type":"string","enum":["positive","negative","neutral"]}"#,
    ),
    (
        "colors",
        "List the colors of the French flag.",
        r#"{"type":"array","items":{"type":"string","enum":["red","green","blue","white","black","yellow"]},"minItems":1,"maxItems":5}"#,
    ),
    (
        "city",
        "Describe the capital of Japan as JSON with its name, country and population.",
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":30},"country":{"type":"string","maxLength":30},"population":{"type":"integer","minimum":0}},"required":["name","country"]}"#,
    ),
    (
        "date",
        "On what date did the first person walk on the moon?",
        r#"{"type":"string","pattern":"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}"#,
    ),
    (
        "temperature",
        "What is a typical summer temperature in Madrid, in Celsius?",
        r#"{"type":"object","properties":{"temperature":{"type":"number","minimum":-50,"maximum":60}},"required":["temperature"],"additionalProperties":false}"#,
    ),
    (
        "maybe_name",
        "What is the name of the king of Switzerland, if there is one?",
        r#"{"anyOf":[{"type":"string","maxLength":20},{"type":"null"}]}"#,
    ),
    (
        "segment",
        "Give a line segment from the origin to the point three, four as JSON.",
        r##"{"$defs":{"point":{"type":"object","properties":{"x":{"type":"integer","minimum":-100,"maximum":100},"y":{"type":"integer","minimum":-100,"maximum":100}},"required":["x","y"],"additionalProperties":false}},"type":"object","properties":{"from":{"$ref":"#/$defs/point"},"to":{"$ref":"#/$defs/point"}},"required":["from","to"],"additionalProperties":false}"##,
    ),
    (
        "status",
        "Report that the system is working.",
        r#"{"type":"object","properties":{"version":{"const":1},"status":{"enum":["ok","error"]}},"required":["version","status"],"additionalProperties":false}"#,
    ),
    (
        "recipe",
        "Give a simple pancake recipe as JSON.",
        r#"{"type":"object","properties":{"title":{"type":"string","maxLength":40},"ingredients":{"type":"array","items":{"type":"string","maxLength":24},"maxItems":6},"minutes":{"type":"integer","minimum":1,"maximum":600}},"required":["title","ingredients","minutes"],"additionalProperties":false}"#,
    ),
    (
        "tags",
        "Give a few tags for a blog post about hiking.",
        r#"{"type":"array","items":{"type":"string","minLength":1,"maxLength":12},"maxItems":4}"#,
    ),
    (
        "rating",
        "Rate the movie Titanic from 1 to 10.",
        r#"{"type":"integer","minimum":1,"maximum":10}"#,
    ),
    (
        "optional_fields",
        "Describe a cat with some of the fields a, b and c.",
        r#"{"type":"object","properties":{"a":{"type":"string","maxLength":20},"b":{"type":"integer"},"c":{"type":"boolean"}},"additionalProperties":false}"#,
    ),
    (
        "string_or_number",
        "How many legs does a spider have?",
        r#"{"type":["string","number"],"maxLength":20}"#,
    ),
    (
        "book",
        "Describe the book Nineteen Eighty-Four as JSON with its author.",
        r#"{"type":"object","properties":{"title":{"type":"string","maxLength":40},"author":{"type":"object","properties":{"name":{"type":"string","maxLength":30},"born":{"type":"integer","minimum":1000,"maximum":2100}},"required":["name","born"],"additionalProperties":false},"year":{"type":"integer","minimum":0,"maximum":2100}},"required":["title","author","year"],"additionalProperties":false}"#,
    ),
    (
        "tree",
        "Give a small tree of numbers as JSON.",
        r##"{"$defs":{"node":{"type":"object","properties":{"value":{"type":"integer","minimum":0,"maximum":99},"children":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":2}},"required":["value"],"additionalProperties":false}},"$ref":"#/$defs/node"}"##,
    ),
    (
        "fibonacci",
        "Pick a small Fibonacci number.",
        r#"{"enum":[1,2,3,5,8,13]}"#,
    ),
    (
        "email",
        "Give an example email address as JSON.",
        r#"{"type":"object","properties":{"email":{"type":"string","pattern":"^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"}},"required":["email"],"additionalProperties":false}"#,
    ),
    (
        "event",
        "Plan a team meeting as JSON.",
        r#"{"type":"object","properties":{"name":{"type":"string","maxLength":30},"day":{"enum":["monday","tuesday","wednesday","thursday","friday"]},"hour":{"type":"integer","minimum":0,"maximum":23},"online":{"type":"boolean"}},"required":["name","day","hour","online"],"additionalProperties":false}"#,
    ),
    (
        "shopping",
        "Write a short shopping list as JSON.",
        r#"{"type":"array","items":{"type":"object","properties":{"item":{"type":"string","maxLength":20},"qty":{"type":"integer","minimum":1,"maximum":99}},"required":["item","qty"],"additionalProperties":false},"minItems":1,"maxItems":3}"#,
    ),
    (
        "nickname",
        "What is the nickname of New York City?",
        r#"{"type":"object","properties":{"nickname":{"type":["string","null"],"maxLength":15}},"required":["nickname"],"additionalProperties":false}"#,
    ),
    ("any_json", "Say hello in JSON.", r#"{}"#),
    (
        "summary",
        "Summarize the story of Cinderella in one sentence.",
        r#"{"type":"string","minLength":5,"maxLength":60}"#,
    ),
];

/// (name, task, regex): answers that match a regex as a whole.
pub const REGEXES: &[(&str, &str, &str)] = &[
    ("yes_no", "Is water wet? Answer yes or no.", "(yes|no)"),
    ("phone", "Give a phone number.", "[0-9]{3}-[0-9]{4}"),
    (
        "full_name",
        "Name a famous painter.",
        "[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}",
    ),
];

/// The five ways each task is asked in the tests.
pub const FRAMINGS: [&str; 5] = [
    "{task}",
    "{task} Answer only with the answer.",
    "Please help me. {task}",
    "I need this for my app: {task}",
    "{task} Be brief.",
];
