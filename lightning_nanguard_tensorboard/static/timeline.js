// Timeline view: incidents on the step axis, over the gradient norm and the training loss.

import {ACTION_TEXT, KIND_GROUPS, h, kindGroup, num, s} from './dom.js';

const LEFT = 92;
const RIGHT = 18;
const GAP = 10;
const MAX_GUIDES = 400; // dashed lines through the curves, one per incident, up to this many incidents

function scaleLinear(d0, d1, r0, r1) {
  const span = d1 - d0 || 1;
  return (v) => r0 + ((v - d0) / span) * (r1 - r0);
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const magnitude = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * magnitude).find((m) => m >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

/** A y scale for the finite values of a series: log when they span more than two decades. */
function valueScale(values, top, bottom) {
  const finite = values.filter((v) => Number.isFinite(v));
  if (!finite.length) return null;
  let lo = Math.min(...finite);
  let hi = Math.max(...finite);
  const log = lo > 0 && hi / lo > 100;
  if (log) {
    const l0 = Math.floor(Math.log10(lo));
    const l1 = Math.ceil(Math.log10(hi));
    const map = scaleLinear(l0, l1 === l0 ? l0 + 1 : l1, bottom, top);
    const ticks = [];
    const stride = Math.max(1, Math.ceil((l1 - l0) / 4));
    for (let e = l0; e <= l1; e += stride) ticks.push(Math.pow(10, e));
    return {map: (v) => map(Math.log10(v)), ticks, log: true};
  }
  if (hi === lo) {
    lo -= Math.abs(lo) * 0.5 || 1;
    hi += Math.abs(hi) * 0.5 || 1;
  } else {
    const pad = (hi - lo) * 0.08;
    lo = lo >= 0 && lo - pad < 0 ? 0 : lo - pad;
    hi += pad;
  }
  return {map: scaleLinear(lo, hi, bottom, top), ticks: niceTicks(lo, hi, 3), log: false};
}

// Non-finite values (older runs logged a NaN norm at bad steps) are left out, not drawn as gaps:
// the incident markers show those steps.
function linePath(points, x, y) {
  return points.filter(([, v]) => v !== null && Number.isFinite(v))
      .map(([step, value], i) => `${i ? 'L' : 'M'}${x(step).toFixed(1)},${y(value).toFixed(1)}`).join('');
}

function markerShape(action, cx, cy, r) {
  if (action === 'rolled_back') {
    return s('path', {d: `M${cx},${cy - r - 1}L${cx + r + 1},${cy}L${cx},${cy + r + 1}L${cx - r - 1},${cy}Z`});
  }
  if (action === 'warned') {
    return s('path', {d: `M${cx},${cy - r - 1}L${cx + r + 1},${cy + r}L${cx - r - 1},${cy + r}Z`});
  }
  if (action === 'raised') return s('rect', {x: cx - r, y: cy - r, width: 2 * r, height: 2 * r});
  return s('circle', {cx, cy, r});
}

function markerTitle(m) {
  const parts = [`step ${m.step}`, `epoch ${m.epoch ?? '?'}`];
  if (m.rank) parts.push(`rank ${m.rank}`);
  parts.push((m.kinds || []).join(', '), ACTION_TEXT[m.action] || m.action);
  if (m.cause) parts.push(`cause ${m.cause}`);
  if (m.remedies) parts.push(`${m.remedies} remedies`);
  parts.push(`loss ${num(m.loss)}`, `grad norm ${num(m.grad_norm)}`);
  return parts.join(' · ') + ' (click to open)';
}

function panel(chart, {label, top, height, points, x, width, cls}) {
  const values = points.map(([, v]) => v).filter((v) => v !== null);
  const y = valueScale(values, top + 6, top + height - 4);
  chart.appendChild(s('rect', {class: 'panel-bg', x: LEFT, y: top, width: width - LEFT - RIGHT, height}));
  chart.appendChild(s('text', {class: 'panel-label', x: width - RIGHT - 6, y: top + 13, 'text-anchor': 'end'},
      label + (y && y.log ? ' (log scale)' : '')));
  if (!y) {
    chart.appendChild(s('text', {class: 'empty', x: LEFT + 6, y: top + height / 2 + 4}, 'no finite values logged'));
    return;
  }
  for (const tick of y.ticks) {
    const ty = y.map(tick);
    if (ty < top - 1 || ty > top + height + 1) continue;
    chart.appendChild(s('line', {class: 'grid', x1: LEFT, x2: width - RIGHT, y1: ty, y2: ty}));
    chart.appendChild(s('text', {class: 'tick', x: LEFT - 6, y: ty + 4, 'text-anchor': 'end'}, num(tick)));
  }
  chart.appendChild(s('path', {class: `series ${cls}`, d: linePath(points, x, y.map)}));
  const finite = points.filter(([, v]) => v !== null && Number.isFinite(v));
  if (finite.length === 1) chart.appendChild(s('circle', {class: `dot ${cls}`, cx: x(finite[0][0]), cy: y.map(finite[0][1]), r: 2.5}));
}

/**
 * The timeline card of one run.
 * @param {object} data the `timeline` route's answer
 * @param {object} options {width, stepRange: [lo, hi] shared by the runs shown, onOpen(run, index), onLossTag(run, tag)}
 */
export function timelineCard(data, {width, stepRange, onOpen, onLossTag}) {
  const [s0, s1] = stepRange || data.step_range || [0, 1];
  const lo = s0 >= 0 && s0 <= 0.25 * s1 ? 0 : s0; // training starts at step 0: show it unless far away
  const hi = s1 > lo ? s1 : lo + 1;
  const pad = (hi - lo) * 0.012; // markers at the first and last steps stay clear of the frame
  const x = scaleLinear(lo - pad, hi + pad, LEFT, width - RIGHT);
  const all = data.markers || [];
  const markers = all.filter((m) => kindGroup(m.kinds) !== 'precursor');
  const precursors = all.filter((m) => kindGroup(m.kinds) === 'precursor');
  const counters = data.counters || {};
  const overflow = counters.amp_overflow || [];

  const panels = [];
  panels.push({label: 'gradient norm', points: data.grad_norm || [], height: 120, cls: 'grad'});
  if (data.loss) panels.push({label: data.loss.tag, points: data.loss.points, height: 100, cls: 'loss'});
  let top = 8;
  const chart = s('svg', {class: 'timeline-chart', width, role: 'img'});
  const guides = s('g', {class: 'guides'});
  for (const p of panels) {
    p.top = top;
    top += p.height + GAP;
  }
  const laneTop = top;
  const laneHeight = 46;
  top += laneHeight + GAP;
  let precursorTop = null;
  if (precursors.length) {
    precursorTop = top;
    top += 30 + GAP;
  }
  let overflowTop = null;
  if (overflow.length) {
    overflowTop = top;
    top += 34 + GAP;
  }
  const axisTop = top;
  const height = axisTop + 24;
  chart.setAttribute('height', height);
  chart.setAttribute('viewBox', `0 0 ${width} ${height}`);

  for (const p of panels) panel(chart, {...p, x, width});
  chart.appendChild(guides);

  // incident lane
  chart.appendChild(s('rect', {class: 'panel-bg lane', x: LEFT, y: laneTop, width: width - LEFT - RIGHT, height: laneHeight}));
  chart.appendChild(s('text', {class: 'panel-label', x: LEFT - 6, y: laneTop + laneHeight / 2 + 4, 'text-anchor': 'end'}, 'incidents'));
  const perStep = new Map();
  for (const m of markers) {
    const k = perStep.get(m.step) || 0;
    perStep.set(m.step, k + 1);
    const cx = x(m.step);
    const cy = laneTop + laneHeight / 2 + ((k % 3) - 1) * 12 * (k > 0 ? 1 : 0);
    const group = kindGroup(m.kinds);
    if (markers.length <= MAX_GUIDES) guides.appendChild(s('line', {class: `guide g-${group}`, x1: cx, x2: cx, y1: 8, y2: laneTop}));
    const marker = s('g', {
      class: `marker g-${group}`,
      tabindex: 0,
      dataset: {index: m.index, step: m.step},
      onclick: () => onOpen(data.run, m.index),
      onkeydown: (e) => (e.key === 'Enter' ? onOpen(data.run, m.index) : null),
    }, s('title', {}, markerTitle(m)), markerShape(m.action, cx, cy, 5));
    if (m.remedies) marker.appendChild(s('circle', {class: 'remedy-ring', cx, cy, r: 9}));
    chart.appendChild(marker);
  }

  if (precursorTop !== null) {  // early warnings: the step was applied, so they stay out of the incident lane
    chart.appendChild(s('rect', {class: 'panel-bg lane precursor-lane', x: LEFT, y: precursorTop, width: width - LEFT - RIGHT, height: 30}));
    chart.appendChild(s('text', {class: 'panel-label', x: LEFT - 6, y: precursorTop + 19, 'text-anchor': 'end'}, 'precursors'));
    for (const m of precursors) {
      const cx = x(m.step);
      const cy = precursorTop + 15;
      const title = `step ${m.step} · early warning in ${m.module || '?'}: ${m.signal || 'precursor'} ${num(m.value)} · step applied (click to open)`;
      chart.appendChild(s('g', {
        class: 'marker g-precursor',
        tabindex: 0,
        dataset: {index: m.index, step: m.step},
        onclick: () => onOpen(data.run, m.index),
        onkeydown: (e) => (e.key === 'Enter' ? onOpen(data.run, m.index) : null),
      }, s('title', {}, title), s('path', {d: `M${cx} ${cy - 6} L${cx + 6} ${cy + 5} L${cx - 6} ${cy + 5} Z`})));
    }
  }

  if (overflowTop !== null) {
    chart.appendChild(s('rect', {class: 'panel-bg lane', x: LEFT, y: overflowTop, width: width - LEFT - RIGHT, height: 34}));
    chart.appendChild(s('text', {class: 'panel-label', x: LEFT - 6, y: overflowTop + 21, 'text-anchor': 'end'}, 'AMP overflows'));
    const most = Math.max(...overflow.map(([, n]) => n));
    for (const [step, count] of overflow) {
      const barHeight = Math.max(3, (count / most) * 28);
      chart.appendChild(s('rect', {class: 'overflow-bar', x: x(step) - 1.5, y: overflowTop + 32 - barHeight, width: 3, height: barHeight},
          s('title', {}, `step ${step}: ${count} AMP overflow step(s) skipped by the GradScaler`)));
    }
  }

  // step axis
  chart.appendChild(s('line', {class: 'axis', x1: LEFT, x2: width - RIGHT, y1: axisTop, y2: axisTop}));
  for (const tick of niceTicks(lo, hi, Math.max(2, Math.floor((width - LEFT) / 90)))) {
    if (!Number.isInteger(tick)) continue;
    const tx = x(tick);
    chart.appendChild(s('line', {class: 'axis', x1: tx, x2: tx, y1: axisTop, y2: axisTop + 4}));
    chart.appendChild(s('text', {class: 'tick', x: tx, y: axisTop + 16, 'text-anchor': 'middle'}, num(tick)));
  }

  const total = markers.length;
  const steps = new Set(markers.map((m) => m.step)).size;
  const header = h('div', {class: 'card-head'},
      h('h3', {}, data.run),
      h('span', {class: 'muted'}, `${total} incident${total === 1 ? '' : 's'} at ${steps} step${steps === 1 ? '' : 's'}`),
      lossSelector(data, onLossTag));
  return h('section', {class: 'card timeline-card', dataset: {run: data.run}}, header, chart, legend(markers, overflow.length > 0, precursors.length > 0));
}

function lossSelector(data, onLossTag) {
  const tags = data.loss_tags || [];
  if (tags.length < 2) return null;
  const select = h('select', {class: 'loss-tag', title: 'loss curve to draw', onchange: (e) => onLossTag(data.run, e.target.value)},
      tags.map((tag) => h('option', {value: tag, selected: data.loss && data.loss.tag === tag}, tag)));
  return h('label', {class: 'muted'}, 'loss: ', select);
}

function legend(markers, hasOverflow, hasPrecursors) {
  const groups = new Set(markers.map((m) => kindGroup(m.kinds)));
  const actions = new Set(markers.map((m) => m.action));
  const item = (symbol, text) => h('span', {class: 'legend-item'}, symbol, text);
  const swatch = (group, action) => {
    const icon = s('svg', {width: 14, height: 14, class: `marker g-${group}`});
    icon.appendChild(markerShape(action, 7, 7, 4));
    return icon;
  };
  const items = [];
  for (const [group, {label}] of Object.entries(KIND_GROUPS)) if (groups.has(group)) items.push(item(swatch(group, 'skipped'), label));
  for (const action of ['skipped', 'rolled_back', 'warned', 'raised']) {
    if (actions.has(action)) items.push(item(swatch('neutral', action), ACTION_TEXT[action]));
  }
  if (markers.some((m) => m.remedies)) {
    const ring = s('svg', {width: 14, height: 14}, s('circle', {class: 'remedy-ring', cx: 7, cy: 7, r: 5.5}));
    items.push(item(ring, 'remedy applied'));
  }
  if (hasOverflow) items.push(item(h('span', {class: 'overflow-swatch'}), 'AMP overflows (skipped by the GradScaler, not incidents)'));
  if (hasPrecursors) {
    const icon = s('svg', {width: 14, height: 14, class: 'marker g-precursor'}, s('path', {d: 'M7 2 L12 12 L2 12 Z'}));
    items.push(item(icon, 'early warning (the step was applied)'));
  }
  return h('div', {class: 'legend'}, items);
}
