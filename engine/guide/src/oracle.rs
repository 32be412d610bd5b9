//! A naive JSON Schema validator for the keywords this crate compiles: the oracle the tests check
//! every structured answer against, written from the keywords' definitions and sharing nothing
//! with the compiler (it walks the schema and the value; no regular expression but `pattern`).

use serde_json::Value;

/// Checks `value` against `schema` (whose `$ref`s point into `schema` itself); the error names
/// the first place where it fails.
pub fn validate(schema: &Value, value: &Value) -> Result<(), String> {
    check(schema, schema, value, "$")
}

fn check(root: &Value, s: &Value, v: &Value, at: &str) -> Result<(), String> {
    let m = match s {
        Value::Bool(true) => return Ok(()),
        Value::Bool(false) => return Err(format!("{at}: the schema false accepts nothing")),
        Value::Object(m) => m,
        _ => return Err(format!("{at}: not a schema")),
    };
    let fail = |what: String| Err(format!("{at}: {what} ({v})"));
    if let Some(r) = m.get("$ref").and_then(Value::as_str) {
        let target = root
            .pointer(r.trim_start_matches('#'))
            .ok_or_else(|| format!("{at}: $ref {r} points at nothing"))?;
        check(root, target, v, at)?;
    }
    if let Some(alts) = m.get("anyOf").and_then(Value::as_array)
        && !alts.iter().any(|a| check(root, a, v, at).is_ok())
    {
        return fail("no anyOf alternative matches".into());
    }
    if let Some(t) = m.get("type") {
        let names: Vec<&str> = match t {
            Value::String(s) => vec![s],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        if !names.iter().any(|n| is_type(v, n)) {
            return fail(format!("not of type {t}"));
        }
    }
    if let Some(e) = m.get("enum").and_then(Value::as_array)
        && !e.iter().any(|x| equal(x, v))
    {
        return fail("not in enum".into());
    }
    if let Some(c) = m.get("const")
        && !equal(c, v)
    {
        return fail(format!("not the const {c}"));
    }
    check_value(root, m, v, at)
}

/// The keywords of the value's own type.
fn check_value(
    root: &Value,
    m: &serde_json::Map<String, Value>,
    v: &Value,
    at: &str,
) -> Result<(), String> {
    let fail = |what: String| Err(format!("{at}: {what} ({v})"));
    match v {
        Value::String(s) => {
            let n = s.chars().count() as u64;
            if m.get("minLength")
                .and_then(Value::as_u64)
                .is_some_and(|x| n < x)
            {
                return fail("shorter than minLength".into());
            }
            if m.get("maxLength")
                .and_then(Value::as_u64)
                .is_some_and(|x| n > x)
            {
                return fail("longer than maxLength".into());
            }
            if let Some(p) = m.get("pattern").and_then(Value::as_str) {
                let re = regex::Regex::new(p).map_err(|e| format!("{at}: pattern: {e}"))?;
                if !re.is_match(s) {
                    return fail(format!("does not match pattern {p}"));
                }
            }
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            let get = |k: &str| m.get(k).and_then(Value::as_f64);
            if get("minimum").is_some_and(|b| x < b)
                || get("maximum").is_some_and(|b| x > b)
                || get("exclusiveMinimum").is_some_and(|b| x <= b)
                || get("exclusiveMaximum").is_some_and(|b| x >= b)
            {
                return fail("out of bounds".into());
            }
        }
        Value::Array(a) => {
            let n = a.len() as u64;
            if m.get("minItems")
                .and_then(Value::as_u64)
                .is_some_and(|x| n < x)
                || m.get("maxItems")
                    .and_then(Value::as_u64)
                    .is_some_and(|x| n > x)
            {
                return fail("item count out of bounds".into());
            }
            if let Some(items) = m.get("items") {
                for (i, x) in a.iter().enumerate() {
                    check(root, items, x, &format!("{at}[{i}]"))?;
                }
            }
        }
        Value::Object(o) => {
            let props = m.get("properties").and_then(Value::as_object);
            for r in m
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                if !o.contains_key(r) {
                    return fail(format!("missing required {r:?}"));
                }
            }
            for (k, x) in o {
                match props.and_then(|p| p.get(k)) {
                    Some(ps) => check(root, ps, x, &format!("{at}.{k}"))?,
                    None if m.get("additionalProperties") == Some(&Value::Bool(false)) => {
                        return fail(format!("property {k:?} not allowed"));
                    }
                    None => {}
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn is_type(v: &Value, name: &str) -> bool {
    match name {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v
            .as_f64()
            .is_some_and(|f| f.fract() == 0.0 && f.is_finite()),
        "array" => v.is_array(),
        "object" => v.is_object(),
        _ => false,
    }
}

/// JSON equality, numbers by value (1 and 1.0 are equal).
fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| equal(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, p)| y.get(k).is_some_and(|q| equal(p, q)))
        }
        _ => a == b,
    }
}
