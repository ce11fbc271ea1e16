//! Which opcode + modifier combinations a PTX text uses, and which of them the simulator does
//! not model. The answer comes from the real decoder, so it cannot drift from what executes.

use std::collections::BTreeMap;

use crate::error::ParseError;
use crate::module::compile;
pub use crate::module::OpcodeUse;

/// Every instruction of every entry in `text`, in file order, with whether it is supported.
pub fn inventory(text: &str) -> Result<Vec<OpcodeUse>, ParseError> {
    Ok(compile(text)?.1)
}

/// One distinct opcode (all modifiers, as written) of a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpcodeSummary {
    /// How many instructions use it.
    pub count: usize,
    /// Line of the first use.
    pub first_line: usize,
    /// `None` when supported, else why not.
    pub unsupported: Option<String>,
}

/// The distinct opcodes of `text`, sorted.
pub fn summary(text: &str) -> Result<BTreeMap<String, OpcodeSummary>, ParseError> {
    let mut out: BTreeMap<String, OpcodeSummary> = BTreeMap::new();
    for u in inventory(text)? {
        out.entry(u.opcode)
            .and_modify(|s| {
                s.count += 1;
                if s.unsupported.is_none() {
                    s.unsupported.clone_from(&u.unsupported);
                }
            })
            .or_insert(OpcodeSummary {
                count: 1,
                first_line: u.line,
                unsupported: u.unsupported,
            });
    }
    Ok(out)
}

/// The distinct opcodes of `text` the simulator does not support, with the first use.
pub fn unsupported(text: &str) -> Result<BTreeMap<String, OpcodeSummary>, ParseError> {
    let mut all = summary(text)?;
    all.retain(|_, s| s.unsupported.is_some());
    Ok(all)
}
