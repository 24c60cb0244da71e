//! The JSON shape of an event, in (`POST /v1/events`) and out (`GET /v1/export`).
//!
//! Parsed by hand from a `serde_json::Value` rather than derived, so that each bad
//! field gets its own message (a negative count, a count too large for 64 bits, a
//! missing field, an unknown field) and the ingest path can say which event in a batch
//! was wrong. Export writes the same shape, so an export can be posted back.
//!
//! ```json
//! {"request_id": "req-1", "origin": "agent-a", "seq": 17, "tenant": "acme",
//!  "descriptors": [["key", "k1"]], "model": "gpt-4o", "time_ms": 1764489600000,
//!  "kind": "usage", "status": "ok",
//!  "input_tokens": 1200, "cached_input_tokens": 200, "output_tokens": 340}
//! ```
//!
//! `kind` defaults to `"usage"`. A `"void"` names `"target"` (the target's request
//! id, or `"target_key"`, its event key in hex); an `"adjust"` names a target and
//! signed token deltas. A correction carries
//! its target's `tenant` and `time_ms` (see [`Event`]). `event_key` may be sent (an
//! export does); it must match the request id.

use serde_json::{Map, Number, Value, json};

use crate::event::{Body, Event, EventKey, Limits, Status, TokenDeltas, Tokens, ValidationError};

const FIELDS: &[&str] = &[
    "request_id",
    "origin",
    "seq",
    "tenant",
    "descriptors",
    "model",
    "time_ms",
    "kind",
    "status",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "target",
    "target_key",
    "event_key",
];

/// Parses and validates one event from JSON. `now_ms` is the ingesting node's clock.
pub fn parse_event(v: &Value, now_ms: u64, limits: &Limits) -> Result<Event, ValidationError> {
    let obj = v.as_object().ok_or(ValidationError::WrongType {
        field: "(event)".into(),
        expected: "a JSON object",
    })?;
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ValidationError::UnknownField(k.clone()));
    }
    let request_id = string(obj, "request_id")?;
    let origin = string(obj, "origin")?;
    let seq = unsigned(obj, "seq", u64::MAX)?.ok_or(ValidationError::Missing("seq"))?;
    let tenant = string(obj, "tenant")?;
    let descriptors = match obj.get("descriptors") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            if items.len() > limits.descriptors_max {
                return Err(ValidationError::TooManyDescriptors(
                    items.len(),
                    limits.descriptors_max,
                ));
            }
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item.as_array().map(Vec::as_slice) {
                    Some([Value::String(k), Value::String(v)]) => out.push((k.clone(), v.clone())),
                    _ => {
                        return Err(ValidationError::WrongType {
                            field: "descriptors".into(),
                            expected: "an array of [key, value] string pairs",
                        });
                    }
                }
            }
            out
        }
        Some(_) => {
            return Err(ValidationError::WrongType {
                field: "descriptors".into(),
                expected: "an array of [key, value] string pairs",
            });
        }
    };
    let time_ms = unsigned(obj, "time_ms", u64::MAX)?.ok_or(ValidationError::Missing("time_ms"))?;
    let kind = match obj.get("kind") {
        None => "usage",
        Some(Value::String(s)) => s.as_str(),
        Some(_) => {
            return Err(ValidationError::WrongType {
                field: "kind".into(),
                expected: "a string",
            });
        }
    };
    let target = match obj.get("target") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() => Some(EventKey::from_request_id(s)),
        Some(_) => {
            return Err(ValidationError::WrongType {
                field: "target".into(),
                expected: "a non-empty string (the target's request_id)",
            });
        }
    };
    let target = match (target, obj.get("target_key")) {
        (t, None) => t,
        (None, Some(k)) => Some(k.as_str().and_then(EventKey::from_hex).ok_or(
            ValidationError::WrongType {
                field: "target_key".into(),
                expected: "32 hex characters (the target's event_key)",
            },
        )?),
        (Some(_), Some(_)) => {
            return Err(ValidationError::NotAllowed {
                field: "target_key",
                kind: "event that names \"target\"; send one of them",
            });
        }
    };
    let (model, body) = match kind {
        "usage" => {
            if target.is_some() {
                return Err(ValidationError::NotAllowed {
                    field: "target",
                    kind: "usage",
                });
            }
            let status = match obj.get("status") {
                None => return Err(ValidationError::Missing("status")),
                Some(Value::String(s)) => {
                    Status::parse(s).ok_or_else(|| ValidationError::BadValue {
                        field: "status",
                        value: s.clone(),
                        expected: "ok, upstream_error, client_gone, expired",
                    })?
                }
                Some(_) => {
                    return Err(ValidationError::WrongType {
                        field: "status".into(),
                        expected: "a string",
                    });
                }
            };
            let count = |f: &'static str| {
                unsigned(obj, f, limits.tokens_max)?.ok_or(ValidationError::Missing(f))
            };
            let tokens = Tokens {
                input_tokens: count("input_tokens")?,
                cached_input_tokens: unsigned(obj, "cached_input_tokens", limits.tokens_max)?
                    .unwrap_or(0),
                output_tokens: count("output_tokens")?,
            };
            (string(obj, "model")?, Body::Usage { status, tokens })
        }
        "void" | "adjust" => {
            let target = target.ok_or(ValidationError::Missing("target"))?;
            if obj.contains_key("status") {
                return Err(ValidationError::NotAllowed {
                    field: "status",
                    kind: if kind == "void" { "void" } else { "adjust" },
                });
            }
            let model = match obj.get("model") {
                None => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(_) => {
                    return Err(ValidationError::WrongType {
                        field: "model".into(),
                        expected: "a string",
                    });
                }
            };
            if kind == "void" {
                for f in ["input_tokens", "cached_input_tokens", "output_tokens"] {
                    if obj.contains_key(f) {
                        return Err(ValidationError::NotAllowed {
                            field: f,
                            kind: "void",
                        });
                    }
                }
                (model, Body::Void { target })
            } else {
                let delta = |f: &'static str| signed(obj, f, limits.tokens_max);
                let deltas = TokenDeltas {
                    input_tokens: delta("input_tokens")?,
                    cached_input_tokens: delta("cached_input_tokens")?,
                    output_tokens: delta("output_tokens")?,
                };
                (model, Body::Adjust { target, deltas })
            }
        }
        other => {
            return Err(ValidationError::BadValue {
                field: "kind",
                value: other.to_string(),
                expected: "usage, void, adjust",
            });
        }
    };
    let event = Event {
        request_id,
        origin,
        seq,
        tenant,
        descriptors,
        model,
        time_ms,
        body,
    };
    if let Some(sent) = obj.get("event_key") {
        let derived = event.key();
        let ok = sent
            .as_str()
            .and_then(EventKey::from_hex)
            .is_some_and(|k| k == derived);
        if !ok {
            return Err(ValidationError::KeyMismatch {
                sent: sent.to_string(),
                derived: derived.to_hex(),
            });
        }
    }
    event.validate(now_ms, limits)?;
    Ok(event)
}

fn string(obj: &Map<String, Value>, field: &'static str) -> Result<String, ValidationError> {
    match obj.get(field) {
        None | Some(Value::Null) => Err(ValidationError::Missing(field)),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ValidationError::WrongType {
            field: field.into(),
            expected: "a string",
        }),
    }
}

/// An unsigned integer in `0..=max`, or `None` when absent.
fn unsigned(
    obj: &Map<String, Value>,
    field: &'static str,
    max: u64,
) -> Result<Option<u64>, ValidationError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            if let Some(v) = n.as_u64() {
                if v <= max {
                    return Ok(Some(v));
                }
            } else if n.as_i64().is_some() || n.as_f64().is_some_and(|f| f < 0.0) {
                return Err(ValidationError::Negative {
                    field,
                    value: n.to_string(),
                });
            }
            Err(ValidationError::OutOfRange {
                field,
                value: n.to_string(),
                max,
            })
        }
        Some(_) => Err(ValidationError::WrongType {
            field: field.into(),
            expected: "an integer",
        }),
    }
}

/// A signed integer with `|v| <= max`; absent means 0.
fn signed(obj: &Map<String, Value>, field: &'static str, max: u64) -> Result<i64, ValidationError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) if v.unsigned_abs() <= max => Ok(v),
            _ => Err(ValidationError::OutOfRange {
                field,
                value: n.to_string(),
                max,
            }),
        },
        Some(_) => Err(ValidationError::WrongType {
            field: field.into(),
            expected: "an integer",
        }),
    }
}

/// The JSON shape of a stored event (as `GET /v1/export` writes it). Corrections
/// name their target by `target_key` (the store keeps keys, not request ids).
pub fn event_json(e: &Event) -> Value {
    let mut v = json!({
        "event_key": e.key().to_hex(),
        "request_id": e.request_id,
        "origin": e.origin,
        "seq": e.seq,
        "tenant": e.tenant,
        "descriptors": e.descriptors.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "model": e.model,
        "time_ms": e.time_ms,
        "kind": e.body.kind(),
    });
    let obj = v.as_object_mut().expect("json! of an object is an object");
    match &e.body {
        Body::Usage { status, tokens } => {
            obj.insert("status".into(), status.as_str().into());
            obj.insert("input_tokens".into(), tokens.input_tokens.into());
            obj.insert(
                "cached_input_tokens".into(),
                tokens.cached_input_tokens.into(),
            );
            obj.insert("output_tokens".into(), tokens.output_tokens.into());
        }
        Body::Void { target } => {
            obj.insert("target_key".into(), target.to_hex().into());
        }
        Body::Adjust { target, deltas } => {
            obj.insert("target_key".into(), target.to_hex().into());
            obj.insert(
                "input_tokens".into(),
                Number::from(deltas.input_tokens).into(),
            );
            obj.insert(
                "cached_input_tokens".into(),
                Number::from(deltas.cached_input_tokens).into(),
            );
            obj.insert(
                "output_tokens".into(),
                Number::from(deltas.output_tokens).into(),
            );
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::HOUR_MS;

    const NOW: u64 = 490_000 * HOUR_MS;

    fn base() -> Value {
        json!({"request_id": "r1", "origin": "a", "seq": 1, "tenant": "acme",
               "model": "gpt-4o", "time_ms": NOW, "status": "ok",
               "input_tokens": 10, "cached_input_tokens": 2, "output_tokens": 5})
    }

    fn err(v: Value) -> String {
        parse_event(&v, NOW, &Limits::default())
            .expect_err("should be refused")
            .to_string()
    }

    fn with(field: &str, value: Value) -> Value {
        let mut v = base();
        v[field] = value;
        v
    }

    fn without(field: &str) -> Value {
        let mut v = base();
        v.as_object_mut().unwrap().remove(field);
        v
    }

    #[test]
    fn a_well_formed_usage_event_parses() {
        let e = parse_event(&base(), NOW, &Limits::default()).unwrap();
        assert_eq!(e.request_id, "r1");
        assert_eq!(
            e.body,
            Body::Usage {
                status: Status::Ok,
                tokens: Tokens {
                    input_tokens: 10,
                    cached_input_tokens: 2,
                    output_tokens: 5
                }
            }
        );
    }

    #[test]
    fn each_missing_required_field_is_named() {
        for f in [
            "request_id",
            "origin",
            "seq",
            "tenant",
            "model",
            "time_ms",
            "status",
            "input_tokens",
            "output_tokens",
        ] {
            assert_eq!(err(without(f)), format!("missing field \"{f}\""));
        }
    }

    #[test]
    fn a_negative_count_is_refused_as_negative() {
        assert_eq!(
            err(with("input_tokens", json!(-5))),
            "field \"input_tokens\": -5 is negative; token counts are integers >= 0"
        );
    }

    #[test]
    fn a_count_beyond_64_bits_or_the_bound_or_fractional_is_out_of_range() {
        let huge: Value = serde_json::from_str("18446744073709551616").unwrap();
        assert!(err(with("output_tokens", huge)).contains("is not an integer in 0..="));
        assert!(err(with("output_tokens", json!(1u64 << 41))).contains("is not an integer"));
        assert!(err(with("output_tokens", json!(1.5))).contains("is not an integer"));
        assert!(err(with("seq", json!("7"))).contains("expected an integer"));
    }

    #[test]
    fn unknown_fields_and_kinds_are_refused() {
        assert_eq!(
            err(with("inptu_tokens", json!(1))),
            "unknown field \"inptu_tokens\""
        );
        assert!(err(with("kind", json!("refund"))).contains("unknown value \"refund\""));
    }

    #[test]
    fn a_void_needs_a_target_and_carries_no_counts() {
        let mut v = json!({"request_id": "v1", "origin": "a", "seq": 2, "tenant": "acme",
                           "time_ms": NOW, "kind": "void"});
        assert_eq!(err(v.clone()), "missing field \"target\"");
        v["target"] = json!("r1");
        let e = parse_event(&v, NOW, &Limits::default()).unwrap();
        assert_eq!(
            e.body,
            Body::Void {
                target: EventKey::from_request_id("r1")
            }
        );
        v["input_tokens"] = json!(1);
        assert!(err(v).contains("not allowed on a void event"));
    }

    #[test]
    fn an_exported_event_parses_back_to_itself() {
        let e = parse_event(&base(), NOW, &Limits::default()).unwrap();
        let back = parse_event(&event_json(&e), NOW, &Limits::default()).unwrap();
        assert_eq!(back, e);
        let wrong = with("event_key", json!("00".repeat(16)));
        assert!(err(wrong).contains("does not match"));
    }
}
