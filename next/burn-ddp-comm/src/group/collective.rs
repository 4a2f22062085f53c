//! The vocabulary of collective calls: the reduction, the 16-bit formats, and one call with its
//! arguments as ranks compare it and errors name it (and its encoding as three numbers for a
//! frame header or a cross-rank check).

use std::fmt;

/// How an all-reduce combines the ranks' buffers, element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks (in ring order, see [`crate::group`]).
    Sum,
    /// The sum divided by `world_size`: the gradient average of data parallelism.
    Avg,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
        })
    }
}

/// One collective call with its arguments, as compared across ranks and named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Collective {
    /// In-place all-reduce of `len` `f32` values.
    AllReduce {
        /// The reduction.
        op: ReduceOp,
        /// Number of `f32` elements.
        len: usize,
    },
    /// Broadcast of `len` `f32` values from `root`.
    Broadcast {
        /// The rank whose buffer is copied to every other rank.
        root: usize,
        /// Number of `f32` elements.
        len: usize,
    },
    /// Wait until every rank has arrived.
    Barrier,
    /// Every rank contributes `len` `u64` values and receives everyone's, rank-major.
    AllGather {
        /// Number of `u64` values contributed by each rank.
        len: usize,
    },
    /// Every rank contributes `len` `f32` values and receives everyone's, rank-major, bit for
    /// bit (a copy: no arithmetic).
    AllGatherF32 {
        /// Number of `f32` values contributed by each rank.
        len: usize,
    },
    /// Every rank contributes `world_size * len` `f32` values; rank `r` receives the reduction
    /// of block `r` (elements `r * len .. (r + 1) * len`) over the ranks.
    ReduceScatter {
        /// The reduction.
        op: ReduceOp,
        /// Number of `f32` elements each rank receives.
        len: usize,
    },
    /// Every rank contributes one value shared by reference (no bytes copied) and receives every
    /// rank's: ranks that share one address space (threads of one process) only. With `then`, a
    /// second phase: each rank's result computed from every value goes to every rank too.
    AllGatherShared {
        /// The call has a second phase.
        then: bool,
    },
    /// In-place all-reduce of `len` 16-bit floats.
    AllReduceHalf {
        /// The reduction.
        op: ReduceOp,
        /// Number of 16-bit elements.
        len: usize,
        /// Their format.
        format: HalfFloat,
    },
}

/// A 16-bit floating-point format of [`ProcessGroup::all_reduce_half`](crate::group::ExtendedCollectives::all_reduce_half).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HalfFloat {
    /// bfloat16: `f32`'s range, 8 bits of significand.
    Bf16,
    /// IEEE binary16: 11 bits of significand, up to 65,504.
    F16,
}

impl HalfFloat {
    /// The value of `bits` in this format, as `f32` (exact).
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            HalfFloat::Bf16 => half::bf16::from_bits(bits).to_f32(),
            HalfFloat::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }

    /// `value` rounded to this format (to nearest, ties to even), as its bits.
    pub fn from_f32(self, value: f32) -> u16 {
        match self {
            HalfFloat::Bf16 => half::bf16::from_f32(value).to_bits(),
            HalfFloat::F16 => half::f16::from_f32(value).to_bits(),
        }
    }
}

impl fmt::Display for HalfFloat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HalfFloat::Bf16 => "bf16",
            HalfFloat::F16 => "f16",
        })
    }
}

impl Collective {
    /// The call as three numbers (operation code, length, argument), for a frame header or a
    /// cross-rank check; [`decode`](Self::decode) reads them back.
    pub(crate) fn encode(self) -> (u8, u64, u64) {
        let op_code = |op: ReduceOp| match op {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
        };
        match self {
            Collective::AllReduce { op, len } => (1, len as u64, op_code(op)),
            Collective::Broadcast { root, len } => (2, len as u64, root as u64),
            Collective::Barrier => (3, 0, 0),
            Collective::AllGather { len } => (4, len as u64, 0),
            Collective::AllReduceHalf { op, len, format } => (
                5,
                len as u64,
                op_code(op)
                    | match format {
                        HalfFloat::Bf16 => 0,
                        HalfFloat::F16 => 2,
                    },
            ),
            Collective::AllGatherF32 { len } => (6, len as u64, 0),
            Collective::ReduceScatter { op, len } => (7, len as u64, op_code(op)),
            Collective::AllGatherShared { then } => (8, 0, u64::from(then)),
        }
    }

    /// The call [`encode`](Self::encode) described; `None` for an unknown operation code.
    pub(crate) fn decode(code: u8, len: u64, arg: u64) -> Option<Collective> {
        let len = len as usize;
        let op = |arg: u64| {
            if arg & 1 == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Avg
            }
        };
        Some(match code {
            1 => Collective::AllReduce { op: op(arg), len },
            2 => Collective::Broadcast {
                root: arg as usize,
                len,
            },
            3 => Collective::Barrier,
            4 => Collective::AllGather { len },
            5 => Collective::AllReduceHalf {
                op: op(arg),
                len,
                format: if arg & 2 == 0 {
                    HalfFloat::Bf16
                } else {
                    HalfFloat::F16
                },
            },
            6 => Collective::AllGatherF32 { len },
            7 => Collective::ReduceScatter { op: op(arg), len },
            8 => Collective::AllGatherShared { then: arg == 1 },
            _ => return None,
        })
    }

    /// The operation's name without arguments (`"all_reduce"`, `"broadcast"`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduce { .. } => "all_reduce",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Barrier => "barrier",
            Collective::AllGather { .. } => "all_gather",
            Collective::AllReduceHalf { .. } => "all_reduce_half",
            Collective::AllGatherF32 { .. } => "all_gather_f32",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllGatherShared { .. } => "all_gather_shared",
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Collective::AllReduce { op, len } => write!(f, "all_reduce({op}, {len} f32)"),
            Collective::Broadcast { root, len } => {
                write!(f, "broadcast(root {root}, {len} f32)")
            }
            Collective::Barrier => f.write_str("barrier"),
            Collective::AllGather { len } => write!(f, "all_gather({len} u64)"),
            Collective::AllReduceHalf { op, len, format } => {
                write!(f, "all_reduce_half({op}, {len} {format})")
            }
            Collective::AllGatherF32 { len } => write!(f, "all_gather_f32({len} f32)"),
            Collective::ReduceScatter { op, len } => {
                write!(f, "reduce_scatter({op}, {len} f32 per rank)")
            }
            Collective::AllGatherShared { then: false } => f.write_str("all_gather_shared"),
            Collective::AllGatherShared { then: true } => {
                f.write_str("all_gather_shared(then a second phase)")
            }
        }
    }
}
