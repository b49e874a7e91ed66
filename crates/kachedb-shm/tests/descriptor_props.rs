//! Property tests of the descriptor decoder: whatever 64 bytes a peer leaves
//! in a slot, decoding never panics, and what it accepts is consistent.
//!
//! ```text
//! cargo test -p kachedb-shm --release --test descriptor_props
//! PROPTEST_CASES=100000 cargo test -p kachedb-shm --release --test descriptor_props
//! ```
#![cfg(not(loom))]

use kachedb_shm::{Completion, DType, DecodeError, Op, Request, Shape, Status, TensorBlockDescriptor, MAX_DIMS};
use proptest::prelude::*;

/// Random bytes, as a hostile peer would write them.
fn any_frame() -> impl Strategy<Value = TensorBlockDescriptor> {
    prop::array::uniform32(any::<u8>())
        .prop_flat_map(|a| prop::array::uniform32(any::<u8>()).prop_map(move |b| (a, b)))
        .prop_map(|(a, b)| {
            let mut bytes = [0u8; 64];
            bytes[..32].copy_from_slice(&a);
            bytes[32..].copy_from_slice(&b);
            TensorBlockDescriptor::from_bytes(&bytes)
        })
}

/// Random bytes pushed towards the interesting branches: small op, status,
/// dtype and ndim codes (valid and just invalid), unused dims often zero,
/// dims often huge (overflow) or small, page offsets near the valid set.
fn near_valid_frame() -> impl Strategy<Value = TensorBlockDescriptor> {
    (
        any_frame(),
        0u8..=11,
        prop_oneof![Just(0u8), 0u8..=8],
        0u8..=14,
        0u8..=8,
        any::<bool>(),
        prop_oneof![Just(0u32..=1), Just(0u32..=70_000), Just(u32::MAX - 16..=u32::MAX)],
        prop_oneof![(0u64..64).prop_map(|k| k * 64), any::<u64>(), 4000u64..4200],
    )
        .prop_flat_map(|(f, op, status, dtype, ndim, zero_unused, dim_range, offset)| {
            prop::array::uniform6(dim_range).prop_map(move |dims| {
                let mut f = f;
                f.op = op;
                f.status = status;
                f.dtype = dtype;
                f.ndim = ndim;
                f.offset = offset;
                f.shape = dims;
                if zero_unused {
                    for d in f.shape.iter_mut().skip(usize::from(ndim)) {
                        *d = 0;
                    }
                }
                f
            })
        })
}

/// The exact byte length, `None` if it does not even fit in 128 bits.
fn exact_len(dims: &[u32], itemsize: u64) -> Option<u128> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(u128::from(itemsize), |acc, &d| acc.checked_mul(u128::from(d)))
}

/// Whether `LengthOverflow` is a correct verdict for these dims: the exact
/// length exceeds 64 bits, or (the decoder multiplies left to right with
/// overflow checks, as `docs/PROTOCOL.md` says) a zero dim comes after a
/// prefix whose product already overflowed, which it conservatively rejects.
fn overflow_is_right(dims: &[u32], itemsize: u64) -> bool {
    let too_long = match exact_len(dims, itemsize) {
        None => true,
        Some(len) => len > u128::from(u64::MAX),
    };
    too_long || dims.contains(&0)
}

/// Asserts the invariants of a decoded (dtype, shape, len).
fn check_tensor(f: &TensorBlockDescriptor, dtype: DType, shape: &Shape, len: u64) {
    assert_eq!(dtype as u8, f.dtype);
    assert!(shape.ndim() <= MAX_DIMS);
    assert_eq!(shape.ndim(), usize::from(f.ndim));
    assert_eq!(shape.dims(), &f.shape[..shape.ndim()]);
    assert!(f.shape[shape.ndim()..].iter().all(|&d| d == 0), "unused dims must be zero");
    let numel = shape.numel().expect("an accepted shape's numel fits in u64");
    assert_eq!(numel.checked_mul(dtype.itemsize()), Some(len), "len == numel * itemsize, no overflow");
    assert_eq!(exact_len(shape.dims(), dtype.itemsize()), Some(u128::from(len)), "len is the exact product");
    assert_eq!(shape.len_bytes(dtype), Some(len));
}

fn check_request(f: &TensorBlockDescriptor) {
    match Request::decode(f) {
        Ok(r) => {
            assert_eq!(f.status, 0);
            let op = Op::from_code(f.op).expect("accepted op code");
            match r {
                Request::Reserve { key, dtype, shape, len, page_offset } => {
                    assert_eq!(op, Op::Reserve);
                    assert_eq!(key, f.key());
                    check_tensor(f, dtype, &shape, len);
                    assert!(page_offset < 4096 && page_offset & 63 == 0);
                    assert_eq!(page_offset, f.offset);
                    assert!(f.handle == 0 || f.handle == kachedb_shm::RESERVE_CONTINUES);
                }
                Request::Commit { handle, parent } | Request::CommitPin { handle, parent } => {
                    assert!(matches!(op, Op::Commit | Op::CommitPin));
                    assert_eq!(handle, f.handle);
                    assert_eq!(parent.is_some(), f.offset == kachedb_shm::COMMIT_HAS_PARENT);
                    if let Some(parent) = parent {
                        assert_eq!(parent, f.key());
                    }
                }
                Request::CommitAs { handle, key, parent, pin } => {
                    assert_eq!(op, if pin { Op::CommitPin } else { Op::Commit });
                    assert_eq!((handle, key), (f.handle, f.key()));
                    assert_eq!(f.offset, kachedb_shm::COMMIT_NAMES_KEY);
                    assert_eq!(parent.is_some(), f.ndim == kachedb_shm::COMMIT_AS_PARENT_NDIM);
                }
                Request::Abort { handle } | Request::Release { handle } => {
                    assert!(matches!(op, Op::Abort | Op::Release));
                    assert_eq!(handle, f.handle);
                }
                Request::Get { key } | Request::Lookup { key } | Request::Delete { key } => {
                    assert!(matches!(op, Op::Get | Op::Lookup | Op::Delete));
                    assert_eq!(key, f.key());
                }
                Request::Meta { handle, scratch, offset, len } => {
                    assert_eq!(op, Op::Meta);
                    assert_eq!((handle, scratch, offset, len), (f.handle, f.key_lo, f.offset, f.key_hi));
                    assert!((32..=kachedb_shm::MAX_META_LEN as u64).contains(&len));
                }
                Request::Ping => assert_eq!(op, Op::Ping),
                Request::Stats => assert_eq!(op, Op::Stats),
                Request::Wait { key, timeout_us } => {
                    assert_eq!(op, Op::Wait);
                    assert_eq!((key, timeout_us), (f.key(), f.handle));
                }
            }
            // What decodes re-encodes to a frame that decodes to the same.
            assert_eq!(r.op(), op);
            assert_eq!(Request::decode(&r.encode(f.request_id)), Ok(r));
        }
        Err(e) => match e {
            DecodeError::BadMetaLen(len) => assert!(f.op == Op::Meta as u8 && len == f.key_hi),
            DecodeError::StatusInRequest(s) => assert!(s != 0 && s == f.status),
            DecodeError::UnknownOp(o) => assert!(Op::from_code(o).is_none()),
            DecodeError::UnknownStatus(_) => panic!("requests do not decode status"),
            DecodeError::UnknownDType(d) => assert!(DType::from_code(d).is_none() && f.op == Op::Reserve as u8),
            DecodeError::TooManyDims(n) => assert!(usize::from(n) > MAX_DIMS),
            DecodeError::UnusedDimNotZero(i) => assert!(i >= usize::from(f.ndim) && i < MAX_DIMS && f.shape[i] != 0),
            DecodeError::LengthOverflow => {
                let dt = DType::from_code(f.dtype).unwrap();
                assert!(overflow_is_right(&f.shape[..usize::from(f.ndim)], dt.itemsize()));
            }
            DecodeError::BadPageOffset(o) => assert!(o >= 4096 || o & 63 != 0),
            DecodeError::BadReserveFlags(flags) => {
                assert!(f.op == Op::Reserve as u8 && flags == f.handle && flags & !kachedb_shm::RESERVE_CONTINUES != 0)
            }
            DecodeError::BadCommitFlags(flags) => {
                assert!(
                    (f.op == Op::Commit as u8 || f.op == Op::CommitPin as u8)
                        && flags == f.offset
                        && flags != kachedb_shm::COMMIT_HAS_PARENT
                        && flags != kachedb_shm::COMMIT_NAMES_KEY
                        && flags != 0
                )
            }
            DecodeError::BadCommitParent(ndim) => {
                assert!(
                    (f.op == Op::Commit as u8 || f.op == Op::CommitPin as u8)
                        && f.offset == kachedb_shm::COMMIT_NAMES_KEY
                        && ndim == f.ndim
                        && (ndim != 0 || f.shape.iter().any(|&w| w != 0))
                        && (ndim != kachedb_shm::COMMIT_AS_PARENT_NDIM || f.shape[4..].iter().any(|&w| w != 0))
                )
            }
        },
    }
}

fn check_completion(f: &TensorBlockDescriptor) {
    match Completion::decode(f) {
        Ok(c) => {
            assert_eq!(c.op as u8, f.op);
            assert_eq!(c.status as u8, f.status);
            assert_eq!((c.request_id, c.handle, c.offset), (f.request_id, f.handle, f.offset));
            match c.tensor {
                Some((dtype, shape, len)) => {
                    assert!(matches!(c.op, Op::Get | Op::Wait | Op::CommitPin) && c.status == Status::Ok);
                    check_tensor(f, dtype, &shape, len);
                }
                None => assert!(!(matches!(c.op, Op::Get | Op::Wait | Op::CommitPin) && c.status == Status::Ok)),
            }
            // What decodes re-encodes to a frame that decodes to the same.
            assert_eq!(Completion::decode(&c.encode()), Ok(c));
        }
        Err(DecodeError::UnknownOp(o)) => assert!(Op::from_code(o).is_none()),
        Err(DecodeError::UnknownStatus(s)) => assert!(Status::from_code(s).is_none()),
        Err(DecodeError::LengthOverflow) => {
            let dt = DType::from_code(f.dtype).unwrap();
            assert!(overflow_is_right(&f.shape[..usize::from(f.ndim)], dt.itemsize()));
        }
        Err(_) => {
            assert!(
                Op::from_code(f.op).is_some_and(Op::pins) && f.status == Status::Ok as u8,
                "only a GET, WAIT or COMMIT_PIN OK completion checks its shape"
            )
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic either decoder, and what they accept is consistent.
    #[test]
    fn random_bytes_never_panic(f in any_frame()) {
        check_request(&f);
        check_completion(&f);
    }

    /// The same on frames close to valid ones, which reach every branch.
    #[test]
    fn near_valid_frames_decode_consistently(f in near_valid_frame()) {
        check_request(&f);
        check_completion(&f);
    }

    /// A RESERVE built from a checked shape decodes to exactly that shape,
    /// with `len` = the exact numel * itemsize when that fits in 64 bits, and
    /// `LengthOverflow` only when it does not (or, conservatively, when a
    /// prefix of the dims overflows before a zero dim).
    #[test]
    fn reserve_len_matches_reference(
        dims in prop::collection::vec(prop_oneof![0u64..=4, 0u64..=100_000, Just(u64::from(u32::MAX))], 0..=MAX_DIMS),
        dtype in prop::sample::select(DType::ALL),
        key in any::<u128>(),
        page in 0u64..64,
    ) {
        let shape = Shape::new(&dims).unwrap();
        let mut f = TensorBlockDescriptor::request(Op::Reserve, 1, key);
        f.set_shape(dtype, &shape);
        f.offset = page * 64;
        let dims32: Vec<u32> = dims.iter().map(|&d| d as u32).collect();
        let exact = exact_len(&dims32, dtype.itemsize());
        match Request::decode(&f) {
            Ok(Request::Reserve { key: k, dtype: dt, shape: s, len, page_offset }) => {
                prop_assert_eq!(k, key);
                prop_assert_eq!(dt, dtype);
                prop_assert_eq!(s, shape);
                prop_assert_eq!(Some(u128::from(len)), exact);
                prop_assert_eq!(page_offset, page * 64);
            }
            Err(DecodeError::LengthOverflow) => prop_assert!(overflow_is_right(&dims32, dtype.itemsize())),
            got => prop_assert!(false, "decode {:?}, exact len {:?}", got, exact),
        }
        // Whatever fits in 64 bits without a prefix overflow must be accepted.
        if exact.is_some_and(|e| e <= u128::from(u64::MAX)) && !dims32.contains(&0) {
            prop_assert!(Request::decode(&f).is_ok());
        }
    }

    /// Valid requests round-trip through encode and decode unchanged; the
    /// frame carries the request id, status 0 and zeros where the op has no field.
    #[test]
    fn requests_round_trip(
        request_id in any::<u32>(),
        op in prop::sample::select(Op::ALL),
        key in any::<u128>(),
        handle in any::<u64>(),
        dtype in prop::sample::select(DType::ALL),
        dims in prop::collection::vec(0u64..=65_536, 0..=MAX_DIMS),
        page in 0u64..64,
    ) {
        let r = match op {
            Op::Ping => Request::Ping,
            Op::Reserve => {
                let shape = Shape::new(&dims).unwrap();
                let r = Request::reserve(key, dtype, shape, page * 64);
                // Skip the rare shape whose length overflows (decode refuses it too).
                prop_assume!(r.is_ok());
                r.unwrap()
            }
            Op::Commit if page % 3 == 2 => {
                Request::CommitAs { handle, key, parent: (page % 2 == 1).then_some(!key), pin: false }
            }
            Op::CommitPin if page % 3 == 2 => {
                Request::CommitAs { handle, key, parent: (page % 2 == 1).then_some(!key), pin: true }
            }
            Op::Commit => Request::Commit { handle, parent: (page % 2 == 1).then_some(key) },
            Op::CommitPin => Request::CommitPin { handle, parent: (page % 2 == 1).then_some(key) },
            Op::Abort => Request::Abort { handle },
            Op::Get => Request::Get { key },
            Op::Release => Request::Release { handle },
            Op::Lookup => Request::Lookup { key },
            Op::Delete => Request::Delete { key },
            Op::Stats => Request::Stats,
            Op::Wait => Request::Wait { key, timeout_us: handle },
            Op::Meta => Request::Meta { handle, scratch: key as u64, offset: page, len: 32 + page * 4 },
        };
        let f = r.encode(request_id);
        prop_assert_eq!((f.op, f.status, f.request_id), (op as u8, 0, request_id));
        prop_assert_eq!(Request::decode(&f), Ok(r));
        if !matches!(op, Op::Reserve) {
            // A COMMIT's or COMMIT_PIN's `offset` holds its flags: COMMIT_HAS_PARENT exactly when it
            // names a parent, COMMIT_NAMES_KEY exactly when it names the key to commit under.
            let flags = match r {
                Request::Commit { parent: Some(_), .. } | Request::CommitPin { parent: Some(_), .. } => {
                    kachedb_shm::COMMIT_HAS_PARENT
                }
                Request::CommitAs { .. } => kachedb_shm::COMMIT_NAMES_KEY,
                // META's `offset` is where its record starts.
                Request::Meta { offset, .. } => offset,
                _ => 0,
            };
            // A COMMIT naming its key carries its parent in the shape words, low word first.
            let (ndim, shape) = match r {
                Request::CommitAs { parent: Some(p), .. } => (
                    kachedb_shm::COMMIT_AS_PARENT_NDIM,
                    [p as u32, (p >> 32) as u32, (p >> 64) as u32, (p >> 96) as u32, 0, 0],
                ),
                _ => (0, [0; MAX_DIMS]),
            };
            prop_assert_eq!((f.dtype, f.ndim, f.shape, f.offset), (0, ndim, shape, flags));
        }
    }

    /// Valid completions round-trip through encode and decode unchanged.
    #[test]
    fn completions_round_trip(
        request_id in any::<u32>(),
        op in prop::sample::select(Op::ALL),
        status in prop::sample::select(Status::ALL),
        handle in any::<u64>(),
        offset in any::<u64>(),
        dtype in prop::sample::select(DType::ALL),
        dims in prop::collection::vec(0u64..=65_536, 0..=MAX_DIMS),
    ) {
        let pins = op.pins();
        let tensor = if pins && status == Status::Ok {
            let shape = Shape::new(&dims).unwrap();
            shape.len_bytes(dtype).map(|len| (dtype, shape, len))
        } else {
            None
        };
        // GET OK needs a tensor; skip the rare shape whose length overflows.
        prop_assume!(tensor.is_some() || !(pins && status == Status::Ok));
        let c = Completion { request_id, op, status, handle, offset, tensor };
        let f = c.encode();
        prop_assert_eq!(Completion::decode(&f), Ok(c));
        prop_assert_eq!(TensorBlockDescriptor::from_bytes(f.as_bytes()), f);
    }
}
