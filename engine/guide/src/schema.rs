//! JSON Schema to a regular expression over the JSON text that every value it matches is.
//!
//! The expression is built bottom-up, one schema node at a time; `None` is a schema no value
//! satisfies (`false`, an empty `enum`, `minItems` above `maxItems`), which its parents drop or
//! pass on. The text is compact JSON with at most one space where JSON allows whitespace, object
//! members in a fixed order (the `required` list's, then the other properties by name), strings
//! and numbers of bounded length, and recursion (`$ref` to an enclosing schema) expanded to a
//! bounded depth: every text is valid JSON that validates, and not every valid text is produced.
//! A keyword this compiler does not implement is an error naming it, never ignored; keywords
//! that only annotate (`title`, `description`...) are accepted.

use serde_json::{Map, Value};

use crate::GuideError;
use crate::numbers;
use crate::pattern::CHAR;

/// Whitespace where JSON allows it: none or one space.
pub(crate) const WS: &str = "[ ]?";

/// A JSON number: at most 16 integer digits, 15 fraction digits and a two-digit exponent, so
/// every one parses to a finite f64.
const NUMBER: &str = r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,15})?(?:[eE][+-]?[0-9]{1,2})?";

/// How deeply schemas nest.
const MAX_DEPTH: usize = 32;

/// How many times one `$ref` may be open inside itself: a recursive schema is expanded this
/// deep, and the branch that would go deeper is cut.
const MAX_REF_REPEAT: usize = 3;

/// How deeply a schema that allows any value (`true`, `{}`, an object without properties) nests
/// arrays and objects.
const ANY_DEPTH: usize = 2;

/// Keywords that only annotate: accepted, with no effect on what is generated.
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "$schema",
    "$id",
    "$comment",
    "examples",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
];

/// Keywords this compiler implements.
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "$ref",
    "$defs",
    "definitions",
    "minLength",
    "maxLength",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
];

/// A regular expression, or `None` for a schema no value satisfies.
type Re = Option<String>;

/// The expression of every JSON text that `schema` accepts (a subset of them, as the module
/// says).
pub(crate) fn schema_regex(schema: &Value) -> Result<String, GuideError> {
    let c = Compiler {
        root: schema,
        refs: std::cell::RefCell::new(Vec::new()),
    };
    c.schema(schema, "#", 0)?
        .ok_or_else(|| GuideError::InvalidSchema {
            at: "#".into(),
            what: "no JSON value satisfies this schema".into(),
        })
}

struct Compiler<'a> {
    root: &'a Value,
    /// The `$ref`s being expanded, outermost first.
    refs: std::cell::RefCell<Vec<String>>,
}

fn invalid(at: &str, what: impl Into<String>) -> GuideError {
    GuideError::InvalidSchema {
        at: at.to_owned(),
        what: what.into(),
    }
}

fn unsupported(at: &str, keyword: &str, why: &str) -> GuideError {
    GuideError::Unsupported {
        keyword: keyword.to_owned(),
        at: at.to_owned(),
        why: why.to_owned(),
    }
}

/// `(?:a|b|...)` of the alternatives that match something; `None` when none does.
fn any_of(alts: impl IntoIterator<Item = Re>) -> Re {
    let alts: Vec<String> = alts.into_iter().flatten().collect();
    match alts.len() {
        0 => None,
        1 => alts.into_iter().next(),
        _ => Some(format!("(?:{})", alts.join("|"))),
    }
}

/// The regex that matches exactly `text`.
fn literal(text: &str) -> String {
    regex_syntax::escape(text)
}

/// A JSON value as compact JSON text, matched literally.
fn json_literal(v: &Value) -> String {
    literal(&v.to_string())
}

fn string_of(min: usize, max: Option<usize>) -> String {
    match max {
        Some(max) => format!(r#""{CHAR}{{{min},{max}}}""#),
        None => format!(r#""{CHAR}{{{min},}}""#),
    }
}

/// Any JSON value, arrays and objects nested at most `depth` deep.
fn any_value(depth: usize) -> String {
    let string = string_of(0, None);
    let scalar = format!("(?:{string}|{NUMBER}|true|false|null)");
    if depth == 0 {
        return scalar;
    }
    let v = any_value(depth - 1);
    let array = format!(r"\[{WS}(?:{v}(?:{WS},{WS}{v})*)?{WS}\]");
    let member = format!("{string}{WS}:{WS}{v}");
    let object = format!(r"\{{{WS}(?:{member}(?:{WS},{WS}{member})*)?{WS}\}}");
    format!("(?:{scalar}|{array}|{object})")
}

/// A non-negative integer keyword's value.
fn count(m: &Map<String, Value>, key: &str, at: &str) -> Result<Option<usize>, GuideError> {
    match m.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n.min(usize::MAX as u64) as usize))
            .ok_or_else(|| invalid(at, format!("{key} must be a non-negative integer"))),
    }
}

impl Compiler<'_> {
    fn schema(&self, s: &Value, at: &str, depth: usize) -> Result<Re, GuideError> {
        match s {
            Value::Bool(true) => Ok(Some(any_value(ANY_DEPTH))),
            Value::Bool(false) => Ok(None),
            Value::Object(m) => self.object_schema(m, at, depth),
            _ => Err(invalid(at, "a schema is an object or a boolean")),
        }
    }

    fn object_schema(
        &self,
        m: &Map<String, Value>,
        at: &str,
        depth: usize,
    ) -> Result<Re, GuideError> {
        for k in m.keys() {
            if !KEYWORDS.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()) {
                return Err(unsupported(
                    at,
                    k,
                    "this keyword is not implemented for structured output",
                ));
            }
        }
        if depth > MAX_DEPTH {
            return Err(GuideError::TooComplex {
                what: "schema",
                detail: format!("it nests deeper than {MAX_DEPTH}"),
            });
        }
        // The keywords that constrain, beside which `$ref` and `anyOf` must stand alone.
        let constraining: Vec<&str> = m
            .keys()
            .map(String::as_str)
            .filter(|k| !ANNOTATIONS.contains(k) && !["$defs", "definitions"].contains(k))
            .collect();
        if let Some(r) = m.get("$ref") {
            if let Some(other) = constraining.iter().find(|k| **k != "$ref") {
                return Err(unsupported(at, other, "beside $ref"));
            }
            let r = r
                .as_str()
                .ok_or_else(|| invalid(at, "$ref must be a string"))?;
            let target = self.resolve(r, at)?;
            let open = self.refs.borrow().iter().filter(|x| *x == r).count();
            if open >= MAX_REF_REPEAT {
                // A recursive schema, expanded as deep as it goes: this branch is cut.
                return Ok(None);
            }
            self.refs.borrow_mut().push(r.to_owned());
            let re = self.schema(target, r, depth + 1);
            self.refs.borrow_mut().pop();
            return re;
        }
        if let Some(alts) = m.get("anyOf") {
            if let Some(other) = constraining.iter().find(|k| **k != "anyOf") {
                return Err(unsupported(at, other, "beside anyOf"));
            }
            let alts = alts
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or_else(|| invalid(at, "anyOf must be a non-empty array of schemas"))?;
            let mut res = Vec::with_capacity(alts.len());
            for (i, a) in alts.iter().enumerate() {
                res.push(self.schema(a, &format!("{at}/anyOf/{i}"), depth + 1)?);
            }
            return Ok(any_of(res));
        }
        let types = self.types(m, at)?;
        if m.contains_key("enum") || m.contains_key("const") {
            return self.enumeration(m, at, &types);
        }
        let mut alts = Vec::with_capacity(types.len());
        for t in &types {
            alts.push(match *t {
                "null" => Some("null".to_owned()),
                "boolean" => Some("(?:true|false)".to_owned()),
                "string" => self.string(m, at)?,
                "integer" => numbers::integer(m, at)?,
                "number" => numbers::number(m, at)?,
                "array" => self.array(m, at, depth)?,
                "object" => self.object(m, at, depth)?,
                _ => unreachable!("types() checked the names"),
            });
        }
        Ok(any_of(alts))
    }

    /// The schema's types: `type` (a name or a list of names), else every type.
    fn types(&self, m: &Map<String, Value>, at: &str) -> Result<Vec<&'static str>, GuideError> {
        const ALL: [&str; 7] = [
            "object", "array", "string", "number", "integer", "boolean", "null",
        ];
        let names: Vec<&str> = match m.get("type") {
            None => {
                // No type: the types the keywords describe (a keyword constrains only its own
                // type, so values of those types are a subset of the valid ones), else any.
                let has = |ks: &[&str]| ks.iter().any(|k| m.contains_key(*k));
                let mut t = Vec::new();
                if has(&["properties", "required", "additionalProperties"]) {
                    t.push("object");
                }
                if has(&["items", "minItems", "maxItems"]) {
                    t.push("array");
                }
                if has(&["minLength", "maxLength", "pattern"]) {
                    t.push("string");
                }
                if has(&["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"]) {
                    t.push("number");
                }
                if t.is_empty() {
                    t = ALL.iter().copied().filter(|t| *t != "integer").collect();
                }
                return Ok(t);
            }
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(a)) if !a.is_empty() => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| invalid(at, "type must be a name or a list of names"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(invalid(at, "type must be a name or a list of names")),
        };
        let mut out = Vec::with_capacity(names.len());
        for n in names {
            let t = ALL
                .iter()
                .find(|t| **t == n)
                .ok_or_else(|| invalid(at, format!("unknown type {n:?}")))?;
            // "number" already holds every integer.
            if !out.contains(t) {
                out.push(*t);
            }
        }
        if out.contains(&"number") {
            out.retain(|t| *t != "integer");
        }
        Ok(out)
    }

    /// `enum` or `const`: the listed values of the schema's types, as literal JSON.
    fn enumeration(
        &self,
        m: &Map<String, Value>,
        at: &str,
        types: &[&str],
    ) -> Result<Re, GuideError> {
        if let Some(other) = m.keys().find(|k| {
            !ANNOTATIONS.contains(&k.as_str())
                && !["enum", "const", "type", "$defs", "definitions"].contains(&k.as_str())
        }) {
            return Err(unsupported(at, other, "beside enum or const"));
        }
        let mut values: Vec<&Value> = Vec::new();
        if let Some(e) = m.get("enum") {
            values.extend(
                e.as_array()
                    .ok_or_else(|| invalid(at, "enum must be an array"))?,
            );
        }
        if let Some(c) = m.get("const") {
            if m.contains_key("enum") && !values.contains(&c) {
                return Ok(None);
            }
            values = vec![c];
        }
        let of_type = |v: &Value| {
            types.iter().any(|t| match (*t, v) {
                ("null", Value::Null) => true,
                ("boolean", Value::Bool(_)) => true,
                ("string", Value::String(_)) => true,
                ("number", Value::Number(_)) => true,
                ("integer", Value::Number(n)) => {
                    n.is_i64() || n.is_u64() || n.as_f64().is_some_and(|f| f.fract() == 0.0)
                }
                ("array", Value::Array(_)) => true,
                ("object", Value::Object(_)) => true,
                _ => false,
            })
        };
        Ok(any_of(
            values
                .into_iter()
                .filter(|v| of_type(v))
                .map(|v| Some(json_literal(v))),
        ))
    }

    /// Resolves a `$ref`: `#`, or a JSON pointer into this document (`#/$defs/name`).
    fn resolve(&self, r: &str, at: &str) -> Result<&Value, GuideError> {
        let Some(pointer) = r.strip_prefix('#') else {
            return Err(unsupported(
                at,
                "$ref",
                "only references into this schema (#/$defs/...) are supported",
            ));
        };
        // JSON pointer escapes (~1 is /, ~0 is ~) are what `Value::pointer` reads; percent
        // escapes of a URI fragment are not used by schemas in practice.
        self.root
            .pointer(pointer)
            .ok_or_else(|| invalid(at, format!("$ref {r:?} points at nothing")))
    }

    fn string(&self, m: &Map<String, Value>, at: &str) -> Result<Re, GuideError> {
        let min = count(m, "minLength", at)?.unwrap_or(0);
        let max = count(m, "maxLength", at)?;
        if let Some(p) = m.get("pattern") {
            if let Some(k) = ["minLength", "maxLength"]
                .iter()
                .find(|k| m.contains_key(**k))
            {
                return Err(unsupported(at, k, "beside pattern"));
            }
            let p = p
                .as_str()
                .ok_or_else(|| invalid(at, "pattern must be a string"))?;
            return crate::pattern::string_pattern(p, at).map(Some);
        }
        if max.is_some_and(|max| max < min) {
            return Ok(None);
        }
        Ok(Some(string_of(min, max)))
    }

    fn array(&self, m: &Map<String, Value>, at: &str, depth: usize) -> Result<Re, GuideError> {
        let min = count(m, "minItems", at)?.unwrap_or(0);
        let max = count(m, "maxItems", at)?;
        if max.is_some_and(|max| max < min) {
            return Ok(None);
        }
        let item = match m.get("items") {
            None => Some(any_value(ANY_DEPTH - 1)),
            Some(Value::Array(_)) => {
                return Err(unsupported(
                    at,
                    "items",
                    "a list of item schemas (tuples) is not implemented",
                ));
            }
            Some(i) => self.schema(i, &format!("{at}/items"), depth + 1)?,
        };
        let empty = format!(r"\[{WS}\]");
        let Some(item) = item else {
            return Ok((min == 0).then_some(empty));
        };
        if max == Some(0) {
            return Ok(Some(empty));
        }
        let more = |lo: usize| match max {
            Some(max) => format!("(?:{WS},{WS}{item}){{{lo},{}}}", max - 1),
            None => format!("(?:{WS},{WS}{item}){{{lo},}}"),
        };
        Ok(Some(if min == 0 {
            format!(r"\[{WS}(?:{item}{}){WS}\]|{empty}", more(0))
        } else {
            format!(r"\[{WS}{item}{}{WS}\]", more(min - 1))
        })
        .map(|s| format!("(?:{s})")))
    }

    fn object(&self, m: &Map<String, Value>, at: &str, depth: usize) -> Result<Re, GuideError> {
        let empty = Map::new();
        let props = match m.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return Err(invalid(at, "properties must be an object")),
        };
        let required: Vec<&str> = match m.get("required") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| invalid(at, "required must be a list of names"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(invalid(at, "required must be a list of names")),
        };
        let closed = match m.get("additionalProperties") {
            None | Some(Value::Bool(true)) => false,
            Some(Value::Bool(false)) => true,
            Some(_) => {
                return Err(unsupported(
                    at,
                    "additionalProperties",
                    "only true or false is implemented, not a schema",
                ));
            }
        };
        if props.is_empty() && required.is_empty() && !closed {
            // Any object.
            let member = format!(
                "{}{WS}:{WS}{}",
                string_of(0, None),
                any_value(ANY_DEPTH - 1)
            );
            return Ok(Some(format!(
                r"\{{{WS}(?:{member}(?:{WS},{WS}{member})*)?{WS}\}}"
            )));
        }
        // The members in order: the required ones as listed, then the others by name.
        let mut order: Vec<(&str, bool)> = Vec::new();
        for r in &required {
            if !order.iter().any(|(n, _)| n == r) {
                order.push((r, true));
            }
        }
        for k in props.keys() {
            if !required.contains(&k.as_str()) {
                order.push((k, false));
            }
        }
        let mut members: Vec<(String, bool)> = Vec::with_capacity(order.len());
        for (name, req) in order {
            let value = match props.get(name) {
                Some(s) => self.schema(s, &format!("{at}/properties/{name}"), depth + 1)?,
                // Required but not described: any value, unless no other property may be.
                None if closed => None,
                None => Some(any_value(ANY_DEPTH - 1)),
            };
            match value {
                Some(v) => members.push((
                    format!("{}{WS}:{WS}{v}", json_literal(&Value::String(name.into()))),
                    req,
                )),
                None if req => return Ok(None),
                None => {}
            }
        }
        Ok(Some(format!(r"\{{{WS}{}{WS}\}}", member_list(&members))))
    }
}

/// The members of an object, in order, the optional ones possibly absent, separated by commas:
/// the first member present is one of those up to the first required one, each followed by the
/// rest, each of them after a comma.
fn member_list(members: &[(String, bool)]) -> String {
    let sep = format!("{WS},{WS}");
    // rest[k]: members k.. each after a comma.
    let mut rest = vec![String::new(); members.len() + 1];
    for k in (0..members.len()).rev() {
        let (m, req) = &members[k];
        rest[k] = if *req {
            format!("{sep}{m}{}", rest[k + 1])
        } else {
            format!("(?:{sep}{m})?{}", rest[k + 1])
        };
    }
    let mut firsts = Vec::new();
    let mut all_optional = true;
    for (k, (m, req)) in members.iter().enumerate() {
        firsts.push(format!("{m}{}", rest[k + 1]));
        if *req {
            all_optional = false;
            break;
        }
    }
    let alts = firsts.join("|");
    if all_optional {
        format!("(?:{alts})?")
    } else {
        format!("(?:{alts})")
    }
}
