// Small DOM helpers: elements are built with textContent only (event fields are never parsed as HTML).

const SVG_NS = 'http://www.w3.org/2000/svg';

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function setAttributes(node, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'class') node.setAttribute('class', value);
    else if (key === 'dataset') Object.assign(node.dataset, value);
    else if (key.startsWith('on') && typeof value === 'function') node.addEventListener(key.slice(2), value);
    else if (key === 'style' && typeof value === 'object') Object.assign(node.style, value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  return node;
}

/** An HTML element: h('div', {class: 'x', onclick: fn}, 'text', child, [more]). */
export function h(tag, attrs = {}, ...children) {
  return append(setAttributes(document.createElement(tag), attrs), children);
}

/** An SVG element. */
export function s(tag, attrs = {}, ...children) {
  return append(setAttributes(document.createElementNS(SVG_NS, tag), attrs), children);
}

/** A number as events.jsonl writes it ("nan", "inf", "-inf" strings included), short. */
export function num(value) {
  if (value === null || value === undefined) return '—';
  if (typeof value === 'string') return value;
  if (!Number.isFinite(value)) return String(value);
  if (Number.isInteger(value)) return value.toLocaleString('en-US');
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(3);
  return String(Number(value.toPrecision(4)));
}

/** A numeric value of a field that may be a string ("nan"): NaN for anything non-finite. */
export function numeric(value) {
  return typeof value === 'number' ? value : Number.NaN;
}

export const KIND_GROUPS = {
  nonfinite: {label: 'NaN/Inf', kinds: ['loss', 'grad', 'bn_stats', 'param']},
  loss_scale: {label: 'loss scale collapsed', kinds: ['loss_scale']},
  spike: {label: 'spike', kinds: ['loss_spike', 'grad_spike']},
  precursor: {label: 'precursor', kinds: ['precursor']},
  guard: {label: 'guard error', kinds: ['guard_error']},
};

/** The group of an event's kinds that decides its colour: NaN/Inf first, then loss scale, then spikes. */
export function kindGroup(kinds) {
  for (const [group, {kinds: members}] of Object.entries(KIND_GROUPS)) {
    if ((kinds || []).some((kind) => members.includes(kind))) return group;
  }
  return 'other';
}

export const ACTION_TEXT = {
  skipped: 'step skipped',
  rolled_back: 'rolled back',
  warned: 'applied (warn)',
  raised: 'training stopped',
};

export function chip(text, kind, title) {
  return h('span', {class: `chip chip-${kind}`, title}, text);
}

export function kindChips(kinds) {
  return (kinds || []).map((kind) => chip(kind, kindGroup([kind])));
}

export function actionChip(action) {
  return chip(ACTION_TEXT[action] || action || 'unknown', `action-${action || 'unknown'}`);
}

export function causeChip(cause) {
  return cause ? chip(`cause: ${cause}`, 'cause', causeTitle(cause)) : null;
}

export function causeTitle(cause) {
  return {
    data: 'a proper subset of the samples reproduces it',
    input: 'the batch itself holds NaN/Inf',
    state: 'the weights or optimizer state are at fault: no sample is to blame',
    interaction: 'samples that fail only together',
    batch: 'the batch as a whole, no record is at fault (e.g. a loss averaged over zero targets): no sample is named',
  }[cause] || '';
}

// ------------------------------------------------------------------ what the guard verified (as the terminal panel says it)

function notVerified(reason) {
  return reason ? `not verified: ${reason}` : 'not verified';
}

/** Whether the dataset indices (or records) an event names were verified: 'verified', 'not verified: <reason>', or null. */
export function indicesMark(event) {
  const named = event.dataset_indices || event.sample_records;
  if (!named || typeof event.indices_verified !== 'boolean') return null;
  return event.indices_verified ? 'verified' : notVerified((event.details || {}).indices_unverified);
}

/** Whether the named samples were checked to be at fault, with the passes that took, or null when the event does not say. */
export function blameText(event) {
  if (typeof event.blame_verified !== 'boolean') return null;
  const details = event.details || {};
  let text;
  if (!event.blame_verified) text = notVerified(details.blame_unverified);
  else if (event.cause === 'input') text = 'verified: the samples hold NaN/Inf themselves';
  else text = 'verified: bad beside known-healthy samples';
  const passes = details.verify_passes;
  if (event.blame_verified && Number.isInteger(passes) && passes > 0) text += ` (+${passes} pass${passes > 1 ? 'es' : ''})`;
  if (details.blame_note) text += `; ${details.blame_note}`;
  return text;
}

/** A verification text as a span coloured by its verdict `ok` (class mark-verified / mark-unverified). */
export function mark(text, ok) {
  if (!text) return null;
  return h('span', {class: ok ? 'mark mark-verified' : 'mark mark-unverified'}, text);
}

/** Whether an event says that something it names was not verified (its indices or its blame). */
export function unverified(event) {
  return event.indices_verified === false || event.blame_verified === false;
}

/** The records of one row (a packed sequence, a mixup pair), at most 8 shown: "[10, 11]". */
export function recordsOf(row) {
  row = row || [];
  const shown = row.slice(0, 8).map(String);
  if (row.length > 8) shown.push(`+${row.length - 8} more`);
  return `[${shown.join(', ')}]`;
}

/** A list of names, the first `shown` visible and the rest behind a "+N more" toggle. */
export function nameList(names, shown = 8) {
  names = names || [];
  const head = names.slice(0, shown).map((name) => h('code', {class: 'name'}, name));
  if (names.length <= shown) return h('span', {class: 'names'}, head);
  const rest = h('details', {class: 'more'}, h('summary', {}, `+${names.length - shown} more`),
      names.slice(shown).map((name) => h('code', {class: 'name'}, name)));
  return h('span', {class: 'names'}, head, rest);
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/**
 * The offending samples of an event in a few words: dataset indices ("idx 7, 9"), each row's records
 * ("idx [10, 11], [40]") or positions ("pos 2"); with several training loaders each with its loader
 * ("idx b:7, a:30"); "(not verified)" when the indices or the blame were not verified.
 */
export function sampleSummary(event) {
  const positions = event.offending_samples;
  if (!positions) return '';
  const records = event.sample_records;
  const indices = records ? records.map(recordsOf) : event.dataset_indices;
  const loaders = event.sample_loaders;
  let text;
  if (loaders && loaders.length === positions.length) {
    text = indices ? `idx ${loaders.map((key, i) => `${key}:${indices[i]}`).join(', ')}` :
      `pos ${loaders.map((key, i) => `${key}[${positions[i]}]`).join(', ')}`;
  } else {
    text = indices ? `idx ${indices.join(', ')}` : `pos ${positions.join(', ')}`;
  }
  return unverified(event) ? `${text} (not verified)` : text;
}

/** The offending samples grouped by training loader: [[key, [i, ...]], ...] (indices into offending_samples). */
export function samplesByLoader(event) {
  const groups = new Map();
  (event.sample_loaders || []).forEach((key, i) => {
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(i);
  });
  return [...groups.entries()];
}
